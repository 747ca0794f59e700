"""How much memory the engine gives its KV cache, and how many sequences it batches, per device.

CPU: the budget given (kv_cache_gib, 1 GiB by default). Host memory is shared with the
rest of the machine, so the engine never takes more than it is told.
CUDA: the GPU is the engine's, planned as a serving engine plans it. Once the model is
loaded, one profiling step of max_num_batched_tokens tokens runs (memory_profile.py) and
its peak is measured; the cache then takes what gpu_memory_utilization (0.9 by default, as
vLLM's) of the device's memory leaves after what is in use (weights, the CUDA context,
other processes) and that peak (GpuBudget: the arithmetic alone, on plain numbers).
kv_cache_gib, if given, still wins, and num_kv_blocks over both. The engine logs the plan
in one line (cache_summary); a model that leaves no room says so in one line, with the numbers.
The batch: max_num_seqs, if not given, is 64 on a CPU (a step's cost grows with the batch
there) and 256 on a GPU (decode is memory-bound: more rows are nearly free);
max_num_batched_tokens 1024 on a CPU and 8192 on a GPU (a prefill chunk's tokens cost
little more than a decode step's weights read there, and every step with a chunk runs
eagerly, off the CUDA graphs).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    import torch
    from torch import nn

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


def kv_cache_bytes(config: EngineConfig) -> int:
    """The KV cache's budget where it is given, not measured: kv_cache_gib on any device,
    else the CPU's default (CUDA without kv_cache_gib: gpu_budget)."""
    if config.kv_cache_gib is not None:
        return int(config.kv_cache_gib * 2**30)
    return int(DEFAULT_CPU_KV_CACHE_GIB * 2**30)


@dataclass(frozen=True, slots=True)
class GpuBudget:
    """What a CUDA engine's KV cache is sized from, all in bytes: the device's memory once
    the model is loaded and the profiling step has handed its memory back, and that step's
    measured peak. A pure record, so the arithmetic runs anywhere (tests: fake numbers)."""
    total: int              # the device's memory
    free: int               # free now: the rest holds the weights, the CUDA context and other processes
    utilization: float      # the share of `total` the engine may fill (gpu_memory_utilization)
    activation_peak: int    # the profiling step's peak above what was allocated before it
    step_tokens: int        # that step's tokens (max_num_batched_tokens)
    num_layers: int = 0     # > 0: the backend copies a layer's keys and values out each step (copies_layer_kv)

    @property
    def in_use(self) -> int:
        return self.total - self.free

    @property
    def cache_bytes(self) -> int:
        """The share of the device the engine may fill, less what is in use and the step's
        peak; with a layer copy, num_layers / (num_layers + 1) of that (the copy takes up to
        one layer's share once the cache is full: varlen_packed.py)."""
        budget = int(self.total * self.utilization) - self.in_use - self.activation_peak
        return budget * self.num_layers // (self.num_layers + 1) if self.num_layers and budget > 0 else budget

    def num_blocks(self, bytes_per_block: int, block_size: int) -> int:
        """The blocks the budget holds; ValueError, one line with the numbers, when it holds none."""
        blocks = self.cache_bytes // bytes_per_block
        if blocks < 1:
            raise ValueError(
                f"the model does not fit with a KV cache on this GPU: {self.utilization:.0%} of "
                f"{_gib(self.total)} GiB is {_gib(self.total * self.utilization)} GiB, the weights, the CUDA "
                f"context and other processes hold {_gib(self.in_use)} GiB and a step of {self.step_tokens:,} "
                f"tokens peaks at {_gib(self.activation_peak, 2)} GiB (measured), which leaves "
                f"{_gib(self.cache_bytes, 2)} GiB for the KV cache (one block of {block_size} tokens takes "
                f"{bytes_per_block / 2**20:.2f} MiB); raise gpu_memory_utilization, lower max_num_batched_tokens, "
                "quantize the model, or give kv_cache_gib")
        return int(blocks)

    def describe(self) -> str:
        return (f"{self.utilization:.0%} of {_gib(self.total)} GiB, {_gib(self.in_use)} GiB in use after loading, "
                f"a step of {self.step_tokens:,} tokens peaks at {_gib(self.activation_peak, 2)} GiB (measured)")


def _gib(n: float, digits: int = 1) -> str:
    return f"{n / 2**30:.{digits}f}"


def cache_summary(num_blocks: int, block_size: int, bytes_per_block: int, max_model_len: int,
                  gpu: GpuBudget | None = None) -> str:
    """The start-up line: blocks, tokens, bytes, how many sequences of max_model_len fit, and
    on CUDA the numbers the budget came from."""
    tokens = num_blocks * block_size
    line = (f"KV cache: {num_blocks:,} blocks of {block_size} tokens = {tokens:,} tokens "
            f"({_gib(num_blocks * bytes_per_block, 2)} GiB), {tokens / max_model_len:.1f} sequences of "
            f"max_model_len {max_model_len:,}")
    return f"{line}; {gpu.describe()}" if gpu is not None else line


def gpu_budget(config: EngineConfig, device: torch.device, profile_step: Callable[[int], int],
               num_layers: int, copies_layer_kv: bool) -> GpuBudget:
    """The CUDA budget's numbers, measured: profile_step(max_num_batched_tokens) runs the
    engine's largest step and returns its peak bytes (memory_profile.py); then, with what
    loading and that step freed handed back by PyTorch's allocator (mem_get_info counts its
    cache as used), the device's free memory."""
    import torch
    tokens = max_num_batched_tokens(config, device)
    peak = profile_step(tokens)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return GpuBudget(total, free, config.gpu_memory_utilization, peak, tokens, num_layers if copies_layer_kv else 0)


@contextlib.contextmanager
def weights_must_fit(device: torch.device, model_dir: Path) -> Iterator[None]:
    """Loading the weights inside: on CUDA, running out of memory there becomes one line with
    the numbers (the checkpoint's size on disk, the device's memory and what was free)."""
    if device.type != "cuda":
        yield
        return
    import torch
    free, total = torch.cuda.mem_get_info(device)
    try:
        yield
    except torch.cuda.OutOfMemoryError:
        on_disk = sum(f.stat().st_size for f in Path(model_dir).glob("*") if f.suffix in (".safetensors", ".bin"))
        raise ValueError(
            f"the model does not fit on {device}: its checkpoint is {_gib(on_disk, 2)} GiB ({model_dir}) and "
            f"{_gib(free, 2)} of the device's {_gib(total)} GiB were free when loading began; quantize it "
            "(fp8, w8a16, w4a16), free the device, or use a larger GPU") from None


@dataclass(frozen=True, slots=True)
class KVCachePlan:
    """The KV cache an engine makes: the attention backend that reads it, its element type,
    its blocks and their size; on CUDA without a size given, the numbers it was planned from."""
    backend: AttentionBackend
    kv_dtype: torch.dtype
    block_size: int
    num_blocks: int
    bytes_per_block: int = 0
    gpu: GpuBudget | None = None

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def summary(self, max_model_len: int) -> str:
        return cache_summary(self.num_blocks, self.block_size, self.bytes_per_block, max_model_len, self.gpu)


def kv_cache_plan(config: EngineConfig, device: torch.device, args: LlamaArgs, dtype: torch.dtype,
                  num_seqs: int, model: nn.Module | None = None) -> KVCachePlan:
    """The attention backend and the KV cache's blocks for this model and device; ValueError
    for a backend that cannot serve these settings, or a model that leaves no room. On CUDA,
    unless kv_cache_gib or num_kv_blocks is given, `model` (loaded) runs the profiling step.
    Engine.__init__ builds its cache from it, and the dry run (jobs.dry_run) tells from it
    what a CPU engine's cache will hold before one is built."""
    import torch

    from pipeline.layers import attention
    from pipeline.layers.kv_cache import KVCache

    kv_dtype = torch.int8 if config.kv_cache_dtype == "int8" else dtype
    backend = attention.select(config.attention_backend, device, dtype, kv_dtype,
                               (args.num_heads, args.num_kv_heads, args.head_dim))
    block_size = config.block_size or backend.default_block_size
    backend.check(block_size, dtype, kv_dtype, device)
    per_block = KVCache.bytes_per_block(args.num_layers, args.num_kv_heads, args.head_dim, block_size, kv_dtype)
    gpu = None
    if config.num_kv_blocks:
        num_blocks = config.num_kv_blocks
    elif device.type == "cuda" and config.kv_cache_gib is None:
        if model is None:
            raise ValueError("on CUDA the KV cache is sized by a profiling step of the loaded model: pass it, "
                             "or give kv_cache_gib or num_kv_blocks")
        from pipeline.engine.memory_profile import step_peak_bytes

        def profile_step(tokens: int) -> int:
            return step_peak_bytes(model, device, backend, kv_dtype, block_size, tokens, num_seqs)
        gpu = gpu_budget(config, device, profile_step, args.num_layers, backend.copies_layer_kv)
        num_blocks = gpu.num_blocks(per_block, block_size)
    else:   # as given, or the CPU's default: nothing measured
        num_blocks = KVCache.blocks_for_budget(kv_cache_bytes(config), args.num_layers, args.num_kv_heads,
                                               args.head_dim, block_size, kv_dtype)
    return KVCachePlan(backend, kv_dtype, block_size, num_blocks, per_block, gpu)
