"""How much memory the engine gives its KV cache, and how many sequences it batches, per device.

CPU: the budget given (kv_cache_gib, 1 GiB by default). Host memory is shared with the
rest of the machine, so the engine never takes more than it is told.
CUDA: the GPU is the engine's. Once the model is loaded, the cache takes what
gpu_memory_utilization (0.9 by default, as vLLM's) of the device's memory leaves after
what is in use (weights, the CUDA context, other processes) and a reserve for one
step's activations; kv_cache_gib, if given, still wins.
The batch: max_num_seqs, if not given, is 64 on a CPU (a step's cost grows with the batch
there) and 256 on a GPU (decode is memory-bound: more rows are nearly free);
max_num_batched_tokens 1024 on a CPU and 8192 on a GPU (a prefill chunk's tokens cost
little more than a decode step's weights read there, and every step with a chunk runs
eagerly, off the CUDA graphs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pipeline.layers.attention import AttentionBackend

    from pipeline.config import EngineConfig
    from pipeline.models.llama import LlamaArgs

DEFAULT_CPU_KV_CACHE_GIB = 1.0
DEFAULT_MAX_NUM_SEQS = {"cpu": 64, "cuda": 256}
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cpu": 1024, "cuda": 8192}


def max_num_seqs(config: EngineConfig, device: torch.device) -> int:
    return config.max_num_seqs or DEFAULT_MAX_NUM_SEQS.get(device.type, DEFAULT_MAX_NUM_SEQS["cpu"])


def max_num_batched_tokens(config: EngineConfig, device: torch.device) -> int:
    return config.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS.get(
        device.type, DEFAULT_MAX_NUM_BATCHED_TOKENS["cpu"])


def kv_cache_bytes(config: EngineConfig, device: torch.device, args: LlamaArgs, dtype: torch.dtype,
                   num_seqs: int, copies_layer_kv: bool = False) -> int:
    """The KV cache's budget in bytes; call it after the model is on the device.
    copies_layer_kv: the backend copies a layer's keys and values out of the cache each step
    (varlen_packed.py), up to a whole layer's share of it once the cache is full: on CUDA
    the cache then gets num_layers / (num_layers + 1) of what is free, the rest is that copy's."""
    if config.kv_cache_gib is not None:
        return int(config.kv_cache_gib * 2**30)
    if device.type != "cuda":
        return int(DEFAULT_CPU_KV_CACHE_GIB * 2**30)
    import torch
    torch.cuda.synchronize(device)
    # What loading freed (staging copies, the unfused weights) stays in PyTorch's cache,
    # which mem_get_info counts as used: hand it back before measuring.
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    reserve = activation_reserve_bytes(args, max_num_batched_tokens(config, device), num_seqs, dtype.itemsize,
                                       config.quantization)
    budget = budget_from_free_memory(free, total, config.gpu_memory_utilization, reserve)
    return budget * args.num_layers // (args.num_layers + 1) if copies_layer_kv else budget


def activation_reserve_bytes(args: LlamaArgs, max_num_batched_tokens: int, num_seqs: int, dtype_bytes: int,
                             quantization: str = "none") -> int:
    """An upper bound of one step's live activations: per packed token its hidden states,
    residual, attention output and fused QKV (about 4x hidden) and its gate/up and SiLU
    product (3x intermediate), and float32 logits plus sampling scratch of every row.
    Quantized linears add their scratch (weight_quant.py), one linear at a time: fp8 a
    float32 copy, its scaled quotient and the e4m3 activations of the widest input (9 bytes
    a value); w8a16 on CUDA the largest weight cast to the compute dtype."""
    per_token = (4 * args.hidden_size + 3 * args.intermediate_size) * dtype_bytes
    reserve = max_num_batched_tokens * per_token + num_seqs * args.vocab_size * 4 * 2
    if quantization == "fp8":
        reserve += max_num_batched_tokens * max(args.hidden_size, args.intermediate_size) * 9
    elif quantization == "w8a16":
        qkv = (args.num_heads + 2 * args.num_kv_heads) * args.head_dim
        reserve += args.hidden_size * max(qkv, 2 * args.intermediate_size) * dtype_bytes
    return reserve


def budget_from_free_memory(free: int, total: int, utilization: float, reserve: int) -> int:
    """Bytes for the cache: the share of the device the engine may fill, less what is used and the reserve."""
    budget = int(total * utilization) - (total - free) - reserve
    if budget <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache: {utilization:.0%} of {total / 2**30:.1f} GiB is "
            f"{total * utilization / 2**30:.1f} GiB, {(total - free) / 2**30:.1f} GiB are in use and a step needs "
            f"about {reserve / 2**30:.2f} GiB; raise gpu_memory_utilization, lower max_num_batched_tokens, "
            "or give kv_cache_gib")
    return budget


@dataclass(frozen=True, slots=True)
class KVCachePlan:
    """The KV cache an engine makes: the attention backend that reads it, its element type,
    its blocks and their size."""
    backend: AttentionBackend
    kv_dtype: torch.dtype
    block_size: int
    num_blocks: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


def kv_cache_plan(config: EngineConfig, device: torch.device, args: LlamaArgs, dtype: torch.dtype,
                  num_seqs: int) -> KVCachePlan:
    """The attention backend and the KV cache's blocks for this model and device (on CUDA
    once the model is loaded: the budget is what it leaves); ValueError for a backend that
    cannot serve these settings. Engine.__init__ builds its cache from it, and the dry run
    (jobs.dry_run) tells from it what a CPU engine's cache will hold before one is built."""
    import torch

    from pipeline.layers import attention
    from pipeline.layers.kv_cache import KVCache

    kv_dtype = torch.int8 if config.kv_cache_dtype == "int8" else dtype
    backend = attention.select(config.attention_backend, device, dtype, kv_dtype,
                               (args.num_heads, args.num_kv_heads, args.head_dim))
    block_size = config.block_size or backend.default_block_size
    backend.check(block_size, dtype, kv_dtype, device)
    num_blocks = config.num_kv_blocks or KVCache.blocks_for_budget(
        kv_cache_bytes(config, device, args, dtype, num_seqs, backend.copies_layer_kv),
        args.num_layers, args.num_kv_heads, args.head_dim, block_size, kv_dtype)
    return KVCachePlan(backend, kv_dtype, block_size, num_blocks)
