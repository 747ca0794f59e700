"""The cpu backend: today's paged attention (pipeline/layers/attention/cpu_paged.py) behind the interface.

Layout [num_blocks, kv_heads, block_size, head_dim] per layer, any block size: a block
holds each head's keys contiguously, read in place by the C decode kernel; the C kernel
also rotates q and k and writes the cache in one pass. Off the CPU (or without a
compiler) its PyTorch paths run instead. Decoding rows (a speculative sequence's 1 + K
rows each count as one) come first, then one scaled_dot_product_attention per prefill chunk.

Batch-invariant (`batch_invariant`, set by pipeline/layers/batch_invariant.py): every
row, prefill rows too, is a decode row of the C kernel, attending to the keys up to its
own position in the cache. Each row's scores and sums then run in one order fixed by its
position alone, so it gets the same bits however its prompt was split into chunks,
whether its prefix came from the prefix cache, and whatever else shares the step
(scaled_dot_product_attention's tiling follows the chunk's length).
"""
from __future__ import annotations

import numpy as np
import torch

from pipeline.kernels import cpu_kernels
from pipeline.layers.attention.cpu_paged import (AttentionMetadata, DecodeLayout, PrefillChunk, cache_rows, paged_attention,
                                write_kv)
from pipeline.layers.attention import AttentionBackend, HostToDevice, LayerCache, StepLayout


class CpuBackend(AttentionBackend):
    name = "cpu"
    default_block_size = 16
    supports_int8_kv = True

    def __init__(self):
        self.batch_invariant = False

    def can_be_batch_invariant(self, dtype: torch.dtype) -> bool:
        """The C decode kernel serves this dtype here (its order per row is fixed)."""
        return dtype in cpu_kernels.KERNEL_DTYPES and cpu_kernels.available()

    def layer_cache_shape(self, num_blocks, num_kv_heads, block_size, head_dim):
        return (num_blocks, num_kv_heads, block_size, head_dim)

    def build_metadata(self, layout: StepLayout, num_kv_heads: int, to_device: HostToDevice) -> AttentionMetadata:
        bs = layout.block_size
        rows = cache_rows(layout.slot_mapping, num_kv_heads, bs)
        # Batch-invariant: every sequence's rows are decode rows (prefill rows included).
        d = layout.num_seqs if self.batch_invariant else layout.num_decode_seqs
        decode = None
        if d:
            q_lens, tables, lens = layout.query_lens[:d], layout.block_tables[:d], layout.context_lens[:d]
            if int(q_lens.max()) > 1:   # speculative (or a chunk): row j attends up to itself
                tables = np.repeat(tables, q_lens, axis=0)
                first = np.repeat(np.cumsum(q_lens) - q_lens, q_lens)
                lens = np.repeat(lens - q_lens, q_lens) + (np.arange(len(first)) - first) + 1
            lens = lens.astype(np.int32)
            decode = DecodeLayout(block_tables=to_device("decode_tables", tables),
                                  context_lens=to_device("decode_lens", lens),
                                  tables=tables, lens=lens, block_size=bs)
        prefills = []
        row = int(layout.query_lens[:d].sum())
        device = to_device.device
        for i in range(d, layout.num_seqs):
            n, length = int(layout.query_lens[i]), int(layout.context_lens[i])
            if n == length:   # nothing cached before it: causal over its own keys
                prefills.append(PrefillChunk(row, row + n, None, None))
            else:
                block_ids = to_device(f"prefill_blocks{i}", layout.block_tables[i, :-(-length // bs)])
                q_pos = torch.arange(length - n, length, device=device).unsqueeze(1)
                mask = torch.arange(length, device=device).unsqueeze(0) <= q_pos
                prefills.append(PrefillChunk(row, row + n, block_ids, mask))
            row += n
        return AttentionMetadata(cache_rows=to_device("cache_rows", rows), decode=decode,
                                 prefills=prefills)

    def rotary_write_kv(self, qkv, rotation, meta, cache: LayerCache, num_heads, num_kv_heads) -> bool:
        if not (cpu_kernels.can_write_kv(qkv, cache.k) and cpu_kernels.serves(rotation.cos)):
            return False
        cpu_kernels.rotary_write_kv(qkv, rotation.cos, rotation.sin, meta.cache_rows, cache.k, cache.v,
                                num_heads, num_kv_heads, cache.k_scale, cache.v_scale)
        return True

    def write_kv(self, cache: LayerCache, k, v, meta) -> None:
        write_kv(cache.k, meta.cache_rows, k, cache.k_scale)
        write_kv(cache.v, meta.cache_rows, v, cache.v_scale)

    def forward(self, q, k, v, cache: LayerCache, meta, scale):
        return paged_attention(q, k, v, cache.k, cache.v, meta, scale, cache.k_scale, cache.v_scale)
