"""Attention backends: who owns a layer's KV-cache layout, writes new keys and values into
it, builds the step's attention metadata, and computes attention over the packed batch.

The model runner lays out each step once, on the host, as a `StepLayout` (numpy); a
backend turns it into its own metadata (`build_metadata`), shared by every layer. The
model's attention layer then calls, per layer, `rotary_write_kv` (a backend's fused
rotary + cache write, if it has one), else `write_kv`, then `forward`.

Backends (`select`):
- cpu: the blocked layout [num_blocks, kv_heads, block_size, head_dim] read in place by
  the C kernels (pipeline/kernels), PyTorch paths elsewhere (pipeline/layers/attention/cpu_paged.py). Any
  block size (16 by default); the int8 KV cache. The default on a CPU.
- varlen: FlashAttention-2 inside PyTorch (torch.nn.attention.varlen.varlen_attn): one
  call per layer for the whole packed batch (decodes, speculative rows, prefill chunks
  with or without cached context). CUDA, float16/bfloat16 only. Layout [num_blocks,
  block_size, kv_heads, head_dim]. Where varlen_attn takes a block table (torch >= 2.12)
  it reads the pages in place, and FlashAttention-2's paged KV needs a block size
  divisible by 256 (256 by default); on torch 2.10/2.11 the pages are gathered each step
  (varlen_packed.py, block size 16, no CUDA graphs). flash_entry.py tells them apart.
  The default on CUDA in those dtypes, where a start-up probe passes (choice.py).
- reference: the same varlen semantics in plain PyTorch (gather pages by block table,
  mask by seqused_k and causality), on any device and dtype, any block size: what tests
  compare with the cpu backend, and what the CPU proof of a graph-break-free decode
  forward traces. Slow for long prefills (it pads every query to the longest).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.config import ATTENTION_BACKENDS

BACKENDS = ATTENTION_BACKENDS   # their names: one home, pipeline.config


@dataclass(slots=True)
class LayerCache:
    """One layer's keys and values in its backend's layout; an int8 cache's per-token
    scales (cpu backend only), else None."""
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


@dataclass(slots=True)
class StepLayout:
    """One step's packed tokens, on the host. Sequences in packed order: the first
    `num_decode_seqs` decode (one token, or the last token and its drafts), then prefill
    chunks. A sequence's query rows are its last `query_lens[i]` tokens of
    `context_lens[i]`, each attending causally to the keys up to itself."""
    input_ids: np.ndarray      # [tokens] int64
    positions: np.ndarray      # [tokens] int64
    slot_mapping: np.ndarray   # [tokens] int64, block_id * block_size + offset of each new token
    query_lens: np.ndarray     # [seqs] int32
    context_lens: np.ndarray   # [seqs] int32, tokens each sequence attends to at its last row
    block_tables: np.ndarray   # [seqs, max_blocks] int32, padded with pad_block
    num_decode_seqs: int
    sample_rows: np.ndarray    # [rows] int64, rows whose logits are sampled
    block_size: int
    pad_block: int

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def is_plain_decode(self) -> bool:
        """One token per sequence, no prefill and no drafts: the steps CUDA graphs replay."""
        return self.num_decode_seqs == self.num_seqs and len(self.input_ids) == self.num_seqs


class HostToDevice:
    """numpy arrays to tensors on the device. On a CPU a zero-copy view. On CUDA through a
    persistent pinned buffer per name, copied with non_blocking=True: the host never waits
    for the copy. Before a buffer is written again, the event recorded after its last copy
    is waited on: normally long done (a step's sampled tokens sync the stream), but a
    prefill-only step samples nothing, and the next step must not overwrite a buffer
    whose copy may still be in flight."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pinned: dict[str, torch.Tensor] = {}
        self._copied: dict[str, torch.cuda.Event] = {}

    def __call__(self, name: str, array: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type == "cpu":
            return host
        out = self.stage(name, host).to(self.device, non_blocking=True)
        self._record(name)
        return out

    def copy_into(self, name: str, dst: torch.Tensor, array: np.ndarray) -> None:
        """dst (a device tensor of array's shape) = array, without the host waiting."""
        host = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type == "cpu":
            dst.copy_(host)
            return
        dst.copy_(self.stage(name, host), non_blocking=True)
        self._record(name)

    def stage(self, name: str, host: torch.Tensor) -> torch.Tensor:
        if (copied := self._copied.pop(name, None)) is not None and not copied.query():
            copied.synchronize()   # the previous copy out of this buffer must finish first
        buf = self.pinned.get(name)
        if buf is None or buf.dtype != host.dtype or buf.numel() < host.numel():
            buf = torch.empty(max(2 * host.numel(), 256), dtype=host.dtype, pin_memory=True)
            self.pinned[name] = buf
        staged = buf[:host.numel()].view(host.shape)
        staged.copy_(host)
        return staged

    def _record(self, name: str) -> None:
        event = torch.cuda.Event()
        event.record()
        self._copied[name] = event


class AttentionBackend:
    name = ""
    default_block_size = 16
    supports_cuda_graphs = False   # its forward reads nothing back to the host, allocates nothing per step on the host
    supports_int8_kv = False
    copies_layer_kv = False        # its forward copies a layer's keys and values out (memory_budget leaves room)
    batch_invariant = False        # each row's result independent of the step's other rows (cpu backend)

    def can_be_batch_invariant(self, dtype: torch.dtype) -> bool:
        """Whether this backend can compute each row in an order fixed by its position alone."""
        return False

    def check(self, block_size: int, dtype: torch.dtype, kv_dtype: torch.dtype, device: torch.device) -> None:
        """Raise ValueError when this backend cannot run with these settings."""
        if kv_dtype == torch.int8 and not self.supports_int8_kv:
            raise ValueError(f"the {self.name} attention backend has no int8 KV cache; use attention_backend 'cpu'")

    def layer_cache_shape(self, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int) -> tuple:
        raise NotImplementedError

    def build_metadata(self, layout: StepLayout, num_kv_heads: int, to_device: HostToDevice):
        raise NotImplementedError

    def rotary_write_kv(self, qkv, rotation, meta, cache: LayerCache, num_heads: int, num_kv_heads: int) -> bool:
        """Rotate q and k of qkv in place and store k and v in one fused pass; False when
        this backend has none for these tensors (the caller rotates and calls write_kv)."""
        return False

    def write_kv(self, cache: LayerCache, k: torch.Tensor, v: torch.Tensor, meta) -> None:
        raise NotImplementedError

    def forward(self, q, k, v, cache: LayerCache, meta, scale: float) -> torch.Tensor:
        """q [tokens, heads, head_dim], k and v [tokens, kv_heads, head_dim] (already in the
        cache) -> [tokens, heads, head_dim]."""
        raise NotImplementedError


def select(name: str, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype,
           heads: tuple[int, int, int] | None = None) -> AttentionBackend:
    """The backend called `name`; auto: on CUDA the fastest that runs correctly there
    (choice.py: varlen, else the cpu backend's PyTorch paths, said once in the log), else
    cpu. heads (query heads, KV heads, head_dim) shape the CUDA start-up probe."""
    if name == "auto":
        if device.type == "cuda":
            from pipeline.layers.attention.choice import cuda_backend
            return cuda_backend(device, dtype, kv_dtype, heads)
        name = "cpu"
    if name == "cpu":
        from pipeline.layers.attention.cpu import CpuBackend
        return CpuBackend()
    if name == "varlen":
        from pipeline.layers.attention.choice import varlen_backend
        return varlen_backend()
    if name == "reference":
        from pipeline.layers.attention.varlen import ReferenceVarlenBackend
        return ReferenceVarlenBackend()
    raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}, got {name!r}")
