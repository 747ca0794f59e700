"""The cpu attention backend's attention over the paged KV cache, for a packed batch.

The batch is packed (no padding): decoding rows first, one token each, then prefill
chunks. `AttentionMetadata` is built once per step from the model runner's layout by
cpu.py and shared by every layer.

The cache of a layer is [num_blocks, kv_heads, block_size, head_dim]: a block holds
each head's keys contiguously, so a gathered block is directly a batch of small
matrices for bmm. Decoding attends block by block over exactly the blocks each
sequence owns (no padding to the longest sequence) and combines the blocks with a
per-sequence softmax, as flash-decoding does: on a CPU the memory traffic of
gathering keys, not the arithmetic, is what costs. On a CPU in float32 or bfloat16 the
hand-written kernel in pipeline/kernels reads the blocks in place instead, without any
gathered copy. Every path keeps the softmax statistics in float32 and scales q before
q.k (so float16 scores cannot overflow).

An INT8 cache (layers/quantization/int8_kv_cache.py) comes with per-token scales [num_blocks, kv_heads, block_size]
(k_scale, v_scale); the C kernel reads the int8 blocks in place, the PyTorch paths
dequantize each block they gather. Without them (None) the cache is in the compute dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.kernels import cpu_kernels
from pipeline.layers.quantization.int8_kv_cache import dequantize, write_kv_int8


@dataclass(slots=True)
class PrefillChunk:
    start: int                      # rows of this chunk in the packed batch
    end: int
    block_ids: torch.Tensor | None  # blocks of all keys it attends to; None: no earlier context
    mask: torch.Tensor | None       # [chunk, keys] bool, causal with an offset, when block_ids is set


@dataclass(slots=True)
class DecodeLayout:
    """The blocks each decoding sequence reads, for the C kernel; the PyTorch path asks
    for its flattened form (`flat`), built only when that path runs."""
    block_tables: torch.Tensor  # [seqs, max_blocks] int32, each decoding sequence's blocks (padded)
    context_lens: torch.Tensor  # [seqs] int32, the tokens each one attends to (its new one included)
    tables: "list[list[int]] | np.ndarray"   # the same on the host
    lens: "list[int] | np.ndarray"
    block_size: int
    _flat: "FlatDecodeLayout | None" = None

    @classmethod
    def build(cls, tables: list[list[int]], lens: list[int], block_size: int,
              device: torch.device) -> "DecodeLayout":
        """From each decoding sequence's block table and context length."""
        max_blocks = -(-max(lens) // block_size)
        padded = [table[:max_blocks] + [0] * (max_blocks - len(table[:max_blocks])) for table in tables]
        return cls(block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
                   context_lens=torch.tensor(lens, dtype=torch.int32, device=device),
                   tables=tables, lens=lens, block_size=block_size)

    @property
    def num_seqs(self) -> int:
        return len(self.lens)

    def flat(self, dtype: torch.dtype) -> "FlatDecodeLayout":
        """Built on first use, then shared by every layer of the step."""
        if self._flat is None:
            tables, lens = self.tables, self.lens
            if isinstance(tables, np.ndarray):
                tables, lens = tables.tolist(), lens.tolist()
            self._flat = FlatDecodeLayout.build(tables, lens, self.block_size, self.block_tables.device, dtype)
        return self._flat


@dataclass(slots=True)
class FlatDecodeLayout:
    block_ids: torch.Tensor    # [n] every block read by a decoding sequence, sequence by sequence
    owner: torch.Tensor        # [n] which decoding sequence (row) each block belongs to
    padded_index: torch.Tensor # [n] owner * max_blocks + the block's index within its sequence
    mask: torch.Tensor | None  # [n, 1, 1, block_size] additive: -inf past a sequence's length
    num_seqs: int
    max_blocks: int

    @classmethod
    def build(cls, tables: list[list[int]], lens: list[int], block_size: int,
              device: torch.device, dtype: torch.dtype) -> "FlatDecodeLayout":
        bs = block_size
        block_ids: list[int] = []
        owner: list[int] = []
        padded_index: list[int] = []
        tails: list[int] = []    # valid tokens in each block
        max_blocks = -(-max(lens) // bs)
        for row, (table, length) in enumerate(zip(tables, lens)):
            num_blocks = -(-length // bs)
            block_ids.extend(table[:num_blocks])
            owner.extend([row] * num_blocks)
            padded_index.extend(range(row * max_blocks, row * max_blocks + num_blocks))
            tails.extend([bs] * (num_blocks - 1) + [length - (num_blocks - 1) * bs])
        mask = None
        if min(tails) < bs:   # hide the unused tail of each sequence's last block
            valid = torch.tensor(tails, device=device).unsqueeze(1)
            offsets = torch.arange(bs, device=device).unsqueeze(0)
            mask = torch.zeros(len(tails), bs, device=device, dtype=dtype)
            mask.masked_fill_(offsets >= valid, float("-inf"))
            mask = mask.view(len(tails), 1, 1, bs)
        return cls(block_ids=torch.tensor(block_ids, device=device), owner=torch.tensor(owner, device=device),
                   padded_index=torch.tensor(padded_index, device=device), mask=mask,
                   num_seqs=len(tables), max_blocks=max_blocks)

    def per_seq(self, x: torch.Tensor, fill: float) -> torch.Tensor:
        """Per-block values x [n, ...] laid out as [seqs, max_blocks, ...] (gaps = fill),
        ready for a reduction over dim 1. (index_add_/scatter_reduce_ are far slower on CPU.)"""
        out = x.new_full((self.num_seqs * self.max_blocks, *x.shape[1:]), fill)
        return out.index_copy_(0, self.padded_index, x).view(self.num_seqs, self.max_blocks, *x.shape[1:])


@dataclass(slots=True)
class AttentionMetadata:
    cache_rows: torch.Tensor            # [tokens * kv_heads] where each new token's keys and values go
                                        # in a layer's cache, see cache_rows()
    decode: DecodeLayout | None         # rows 0..decode.num_seqs-1 are single-token decodes
    prefills: list[PrefillChunk]


def cache_rows(slot_mapping: np.ndarray, num_kv_heads: int, block_size: int) -> np.ndarray:
    """Rows of a layer cache viewed as [blocks * kv_heads * block_size, head_dim] that receive
    each new token's heads; slot = block_id * block_size + offset. The same for every layer,
    so computed once per step, on the host (from the step layout's slots)."""
    block, offset = slot_mapping // block_size, slot_mapping % block_size
    return ((block[:, None] * num_kv_heads + np.arange(num_kv_heads)) * block_size + offset[:, None]).reshape(-1)


def write_kv(cache: torch.Tensor, rows: torch.Tensor, x: torch.Tensor,
             scales: torch.Tensor | None = None) -> None:
    """Store x [tokens, kv_heads, head_dim] in cache [blocks, kv_heads, block_size, head_dim]
    (quantized, with its scales, when the cache is int8)."""
    if scales is not None:
        write_kv_int8(cache, scales, rows, x)
    else:
        cache.view(-1, cache.shape[-1]).index_copy_(0, rows, x.reshape(-1, cache.shape[-1]))


def gather_context(cache: torch.Tensor, block_ids: torch.Tensor, length: int,
                   scales: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """One sequence's first `length` keys (or values): [kv_heads, length, head_dim]; from an
    int8 cache dequantized (block by block, with its scales) into dtype."""
    blocks = cache.index_select(0, block_ids)                       # [n, kv_heads, bs, head_dim]
    if scales is not None:
        blocks = dequantize(blocks, scales.index_select(0, block_ids), dtype or torch.float32)
    return blocks.transpose(0, 1).reshape(cache.shape[1], -1, cache.shape[3])[:, :length]


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim], already written to
    the caches (write_kv). Returns [tokens, heads, head_dim]."""
    out = q.new_empty(q.shape)
    if meta.decode is not None:
        b = meta.decode.num_seqs
        decode_attention(q[:b], k_cache, v_cache, meta.decode, scale, out=out[:b],
                         k_scale=k_scale, v_scale=v_scale)
    for chunk in meta.prefills:
        qc = q[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)       # [1, heads, n, head_dim]
        if chunk.block_ids is None:
            kc = k[chunk.start:chunk.end].transpose(0, 1)                 # [kv_heads, n, head_dim]
            vc = v[chunk.start:chunk.end].transpose(0, 1)
        else:
            length = chunk.mask.shape[1]
            kc = gather_context(k_cache, chunk.block_ids, length, k_scale, q.dtype)
            vc = gather_context(v_cache, chunk.block_ids, length, v_scale, q.dtype)
        o = F.scaled_dot_product_attention(
            qc, kc.unsqueeze(0), vc.unsqueeze(0), attn_mask=chunk.mask,
            is_causal=chunk.block_ids is None, scale=scale, enable_gqa=True)
        out[chunk.start:chunk.end] = o[0].transpose(0, 1)
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     layout: DecodeLayout, scale: float, out: torch.Tensor,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """One query token per sequence against its own blocks, into out. q, out: [seqs, heads, head_dim]."""
    if cpu_kernels.can_run_paged_decode_attention(q, k_cache):
        cpu_kernels.paged_decode_attention(q, k_cache, v_cache, layout.block_tables, layout.context_lens,
                                       scale, out=out, k_scales=k_scale, v_scales=v_scale)
    else:
        out.copy_(decode_attention_torch(q, k_cache, v_cache, layout, scale, k_scale, v_scale))


def decode_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           decode_layout: DecodeLayout, scale: float,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    # Scores, softmax and the weighted sum in float32 whatever the cache dtype: bf16 scores
    # lose ~3 digits before the exponential, fp16 ones overflow. q is scaled before q.k.
    layout = decode_layout.flat(torch.float32)
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    keys = k_cache.index_select(0, layout.block_ids).float()           # [n, kv_heads, bs, head_dim]
    values = v_cache.index_select(0, layout.block_ids).float()
    if k_scale is not None:   # int8 cache: dequantize the gathered blocks
        keys.mul_(k_scale.index_select(0, layout.block_ids).unsqueeze(-1))
        values.mul_(v_scale.index_select(0, layout.block_ids).unsqueeze(-1))
    # Grouped-query attention without repeating K/V: queries as [.., kv_heads, group, head_dim].
    q_blocks = (q.float() * scale).view(num_seqs, num_kv_heads, group, head_dim).index_select(0, layout.owner)
    scores = torch.matmul(q_blocks, keys.transpose(-1, -2))             # [n, kv_heads, group, bs]
    if layout.mask is not None:
        scores.add_(layout.mask)
    # Softmax across all blocks of a sequence: shift by the sequence's max, sum per sequence.
    seq_max = layout.per_seq(scores.amax(dim=-1), float("-inf")).amax(dim=1)   # [seqs, kv_heads, group]
    probs = scores.sub_(seq_max.index_select(0, layout.owner).unsqueeze(-1)).exp_()
    denom = layout.per_seq(probs.sum(dim=-1), 0.0).sum(dim=1)
    partial = torch.matmul(probs, values)                              # [n, kv_heads, group, head_dim]
    out = layout.per_seq(partial, 0.0).sum(dim=1).div_(denom.unsqueeze(-1))
    return out.view(num_seqs, num_heads, head_dim).to(q.dtype)
