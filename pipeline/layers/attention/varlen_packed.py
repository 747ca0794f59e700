"""Varlen attention for a torch whose varlen_attn reads contiguous keys only (2.10, 2.11).

Each step gathers every sequence's keys and values out of its pages (by block table, its
first seqused_k of them) into one packed tensor per layer, back to back as cu_seq_k
already says, and calls FlashAttention-2's varlen entry on that. The gather index is
computed once per step, on the device (no per-token host work), and shared by every
layer. The cost: each layer writes and reads its context's keys and values once more
than the paged kernel would (decode attention reads them once: about 3x its memory
traffic), and the gather's length changes every step, so no CUDA graphs. The copy can
reach a whole layer's share of the cache, so the KV budget leaves room for it
(copies_layer_kv, memory_budget.kv_cache_bytes).

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


class PackedVarlenBackend(ReferenceVarlenBackend):
    name = "varlen"
    default_block_size = 16
    supports_cuda_graphs = False   # the gathered keys' count is each step's own
    copies_layer_kv = True

    def __init__(self, kernel=None):
        self.kernel = kernel or installed_varlen_attn()
        self._gqa = gqa_kwargs(self.kernel)

    def check(self, block_size, dtype, kv_dtype, device) -> None:
        super().check(block_size, dtype, kv_dtype, device)
        check_flash(dtype, device)

    def build_metadata(self, layout: StepLayout, num_kv_heads: int, to_device: HostToDevice) -> PackedVarlenMetadata:
        meta = super().build_metadata(layout, num_kv_heads, to_device)
        slots = key_slots(meta.block_table, meta.seqused_k, meta.cu_seq_k, int(layout.context_lens.sum()),
                          layout.block_size)
        return PackedVarlenMetadata(meta.slot_mapping, meta.cu_seq_q, meta.cu_seq_k, meta.seqused_k,
                                    meta.block_table, meta.max_q, meta.max_k, slots)

    def forward(self, q, k, v, cache: LayerCache, meta: PackedVarlenMetadata, scale):
        kv_heads, head_dim = cache.k.shape[2:]
        keys = cache.k.view(-1, kv_heads, head_dim).index_select(0, meta.key_slots)
        values = cache.v.view(-1, kv_heads, head_dim).index_select(0, meta.key_slots)
        return self.kernel(q, keys, values, meta.cu_seq_q, meta.cu_seq_k, meta.max_q, meta.max_k,
                           scale=scale, window_size=causal_window(meta.max_q), **self._gqa)
