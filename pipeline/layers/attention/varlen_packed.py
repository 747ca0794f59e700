"""Varlen attention for a torch whose varlen_attn reads contiguous keys only (2.10, 2.11).

A step with prefill chunks or drafts gathers every sequence's keys and values out of its
pages (by block table, its first seqused_k of them) into one packed tensor per layer,
back to back as cu_seq_k already says, and calls FlashAttention-2's varlen entry on that.
The gather index is computed once per step, on the device (no per-token host work), and
shared by every layer. The cost: each layer writes and reads its context's keys and
values once more than a paged kernel would, and the gather's length changes every step,
so such a step cannot be a CUDA graph. The copy can reach a whole layer's share of the
cache, so the KV budget leaves room for it (copies_layer_kv, memory_budget.GpuBudget).

A decode-only step (one query row per sequence: most of a long job's steps) instead reads
the pages in place with the Triton kernel (pipeline/kernels/paged_decode_triton.py) where
Triton imports: its memory traffic is the context once, and its shapes are the batch
size's, so decode steps replay CUDA graphs. Without Triton decodes gather too, and no
step has graphs.

Layout and cache writes are the paged backend's ([num_blocks, block_size, kv_heads,
head_dim], index_copy_ by slot), but any block size works: the kernel never sees pages.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.layers.attention import HostToDevice, LayerCache, StepLayout
from pipeline.layers.attention.flash_entry import causal_window, gqa_kwargs, installed_varlen_attn
from pipeline.layers.attention.varlen import ReferenceVarlenBackend, VarlenMetadata, check_flash


@dataclass(slots=True)
class PackedVarlenMetadata(VarlenMetadata):
    key_slots: torch.Tensor   # [sum of seqused_k] int64, the cache slot of each sequence's keys in order


def key_slots(block_table: torch.Tensor, seqused_k: torch.Tensor, cu_seq_k: torch.Tensor, total_keys: int,
              block_size: int) -> torch.Tensor:
    """The cache slot (block * block_size + offset) of every key of every sequence, in
    packed order: sequence i's keys 0 .. seqused_k[i] - 1 at cu_seq_k[i] onwards.
    total_keys (a host int) sizes the result, so nothing is read back from the device."""
    device = block_table.device
    owner = torch.repeat_interleave(torch.arange(len(seqused_k), device=device), seqused_k,
                                    output_size=total_keys)
    position = torch.arange(total_keys, device=device) - cu_seq_k[:-1].long().index_select(0, owner)
    return block_table.long()[owner, position // block_size] * block_size + position % block_size


def with_key_slots(meta: VarlenMetadata, total_keys: int, block_size: int) -> PackedVarlenMetadata:
    """meta and the cache slot of every key its step gathers (total_keys: the sum of seqused_k, a host int)."""
    slots = key_slots(meta.block_table, meta.seqused_k, meta.cu_seq_k, total_keys, block_size)
    return PackedVarlenMetadata(meta.slot_mapping, meta.cu_seq_q, meta.cu_seq_k, meta.seqused_k, meta.block_table,
                                meta.max_q, meta.max_k, slots)


def triton_paged_decode():
    """The Triton paged decode kernel, or None where Triton does not import."""
    try:
        from pipeline.kernels.paged_decode_triton import paged_decode_attention
    except ImportError:
        return None
    return paged_decode_attention


class PackedVarlenBackend(ReferenceVarlenBackend):
    name = "varlen"
    default_block_size = 16
    copies_layer_kv = True

    def __init__(self, kernel=None, decode_kernel=None):
        """kernel: torch's packed varlen_attn; decode_kernel: triton_paged_decode()'s
        function for decode-only steps, or None (they gather too, and nothing is graphed:
        the gathered keys' count is each step's own)."""
        self.kernel = kernel or installed_varlen_attn()
        self._gqa = gqa_kwargs(self.kernel)
        self.decode_kernel = decode_kernel
        self.supports_cuda_graphs = decode_kernel is not None

    def check(self, block_size, dtype, kv_dtype, device) -> None:
        super().check(block_size, dtype, kv_dtype, device)
        check_flash(dtype, device)
        if self.decode_kernel is not None and block_size & (block_size - 1):
            raise ValueError(f"the varlen attention backend on torch {torch.__version__} reads decode steps' pages "
                             f"with Triton, which needs a power-of-two block_size, got {block_size}")

    def build_metadata(self, layout: StepLayout, num_kv_heads: int, to_device: HostToDevice) -> VarlenMetadata:
        meta = super().build_metadata(layout, num_kv_heads, to_device)
        if self._reads_pages(meta):
            return meta
        return with_key_slots(meta, int(layout.context_lens.sum()), layout.block_size)

    def forward(self, q, k, v, cache: LayerCache, meta: VarlenMetadata, scale):
        if self._reads_pages(meta):
            return self.decode_kernel(q, cache.k, cache.v, meta.block_table, meta.seqused_k, scale)
        kv_heads, head_dim = cache.k.shape[2:]
        keys = cache.k.view(-1, kv_heads, head_dim).index_select(0, meta.key_slots)
        values = cache.v.view(-1, kv_heads, head_dim).index_select(0, meta.key_slots)
        return self.kernel(q, keys, values, meta.cu_seq_q, meta.cu_seq_k, meta.max_q, meta.max_k,
                           scale=scale, window_size=causal_window(meta.max_q), **self._gqa)

    def _reads_pages(self, meta: VarlenMetadata) -> bool:
        """A decode-only step (CUDA graphs' steps are: DecodeGraphs.metadata) with the Triton kernel."""
        return meta.max_q == 1 and self.decode_kernel is not None
