"""Decode attention over the paged KV cache, in Triton, for a torch whose FlashAttention
varlen entry reads contiguous keys only (2.10, 2.11: varlen_packed.py).

There every step gathers each sequence's keys and values out of their pages before
FlashAttention reads them: a decode's attention then moves its context about three times,
and the gather's length changes every step, so no CUDA graph can hold it. This kernel
reads the pages in place, by block table, once, and its shapes depend only on the batch
size: decode steps get their graphs back.

One program per (sequence, KV head, split): it loads the query rows of the heads that
share that KV head (grouped-query attention: each key and value is read once for all of
them), walks its share of the sequence's keys a tile at a time (each key's page looked
up in the block table), and keeps FlashAttention's running max and sum in float32. With
one split the program writes the normalised output; with several (few sequences, so
more programs fill the GPU) each writes its partial output and log-sum-exp, and
`merge_splits` combines them. Nothing is read back to the host: the loop bounds come from
seqused_k on the device.

On a CPU it runs under Triton's interpreter (TRITON_INTERPRET=1), which is how the tests
compare it with the reference backend.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# The launch's tuning: module attributes read at each launch, which
# benchmarks/paged_decode_sweep.py varies on a GPU. On an H200 (torch 2.11, Triton 3.6), one
# 1B-shaped layer, 256 sequences of 128-640 keys, in a CUDA graph: 61.5 us (78% of the HBM
# bandwidth) with these, the fastest of the sweep, against 63.2-63.5 us with Triton's
# default 3 stages (16 sequences: 15.8 against 16.3 us); 8 warps or 1 stage were the
# slowest (73-92 us), more programs an SM (more splits) slower too. Loading the values with
# the keys instead of after the scores measured the same (63.2 against 63.3 us).
TILE_ELEMENTS = 4096  # keys per iteration x head_dim: 64 keys of 64, 32 of 128 (at most 64)
MAX_SPLITS = 16
PROGRAMS_PER_SM = 4   # splits are added until the grid has about this many programs per SM
NUM_WARPS, NUM_STAGES = 4, 2


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, block_table_ptr, seqused_ptr, scale,
                         stride_q_tok, stride_q_head, stride_k_block, stride_k_slot, stride_k_head,
                         stride_v_block, stride_v_slot, stride_v_head, stride_table,
                         stride_out_tok, stride_out_head, stride_out_split, stride_lse_tok, stride_lse_head,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                         HEAD_DIM_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr,
                         SPLITS: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(seqused_ptr + seq)
    per_split = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK) * BLOCK
    start = split * per_split
    end = tl.minimum(start + per_split, length)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * GROUP + g
    head_ok = g < GROUP
    dim_ok = d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_q_tok + heads[:, None] * stride_q_head + d[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    s = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    table = block_table_ptr + seq.to(tl.int64) * stride_table
    for first in range(start, end, BLOCK):
        n = first + tl.arange(0, BLOCK)
        key_ok = n < end
        page = tl.load(table + n // PAGE, mask=key_ok, other=0).to(tl.int64)
        slot = n % PAGE
        k = tl.load(k_ptr + (page * stride_k_block + slot * stride_k_slot + kv_head * stride_k_head)[:, None]
                    + d[None, :], mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
        scores = tl.dot(q, tl.trans(k)).to(tl.float32) * scale                 # [GROUP_PAD, BLOCK]
        scores = tl.where(key_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))   # finite: the block has a key
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        s = s * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + (page * stride_v_block + slot * stride_v_slot + kv_head * stride_v_head)[:, None]
                    + d[None, :], mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m = m_new

    empty = s == 0.0   # a split past the sequence's end
    out = acc / tl.where(empty, 1.0, s)[:, None]
    out_rows = out_ptr + seq * stride_out_tok + heads[:, None] * stride_out_head + split * stride_out_split
    tl.store(out_rows + d[None, :], out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & dim_ok[None, :])
    if SPLITS > 1:
        lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, s)))
        tl.store(lse_ptr + seq * stride_lse_tok + heads * stride_lse_head + split, lse, mask=head_ok)


def tile_shape(num_heads: int, num_kv_heads: int, head_dim: int) -> dict:
    """The kernel's compile-time tile: query heads a group (padded to tl.dot's 16 rows),
    head_dim padded to a power of two, and keys per iteration (TILE_ELEMENTS of keys x
    head_dim). Compiled for sm_90 as a launch specializes it (tests/triton_compile_check.py),
    a program then takes 59 registers a thread at head_dim 64 and 86 at 128: several fit an
    SM, which this memory-bound kernel needs to keep enough loads in flight."""
    group = num_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    return dict(GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
                HEAD_DIM_PAD=head_dim_pad, BLOCK=max(16, min(64, TILE_ELEMENTS // head_dim_pad)))


def launch_options() -> dict:
    """Warps a program and software-pipeline stages of its loop."""
    return dict(num_warps=NUM_WARPS, num_stages=NUM_STAGES)


def num_splits(num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """Splits per sequence: 1 once the batch alone gives every SM PROGRAMS_PER_SM
    programs, else the power of two that reaches that (a function of the batch size only,
    so a CUDA graph's bucket keeps its launch shape; powers of two, so the graph buckets
    compile a handful of variants)."""
    wanted = -(-PROGRAMS_PER_SM * num_sms // (num_seqs * num_kv_heads))
    return min(MAX_SPLITS, triton.next_power_of_2(max(1, wanted)))


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The device's SM count (1 off CUDA: the interpreter has no use for splits)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, seqused_k: torch.Tensor, scale: float,
                           splits: int | None = None) -> torch.Tensor:
    """q [seqs, heads, head_dim] (one row per sequence), caches [blocks, block_size,
    kv_heads, head_dim], block_table [seqs, pages] int32, seqused_k [seqs] int32 (at least
    1 each) -> [seqs, heads, head_dim] in q's dtype. splits: per sequence, by default
    num_splits for this batch on this device."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if splits is None:
        splits = num_splits(num_seqs, num_kv_heads, multiprocessors(q.device))
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or block_table.stride(-1) != 1:
        raise ValueError("paged_decode_attention needs head_dim (and the block table's pages) contiguous")
    if block_size & (block_size - 1):
        raise ValueError(f"paged_decode_attention needs a power-of-two block size, got {block_size}")
    if splits == 1:
        out = torch.empty(num_seqs, num_heads, 1, head_dim, dtype=q.dtype, device=q.device)
        lse = out   # unused
    else:
        out = torch.empty(num_seqs, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(num_seqs, num_kv_heads, splits)](
        q, k_cache, v_cache, out, lse, block_table, seqused_k, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        **tile_shape(num_heads, num_kv_heads, head_dim), PAGE=block_size, SPLITS=splits, **launch_options())
    if splits == 1:
        return out.squeeze(2)
    return merge_splits(out, lse).to(q.dtype)


def merge_splits(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Combine per-split outputs [seqs, heads, splits, head_dim] (each normalised over its
    own keys) by their log-sum-exp [seqs, heads, splits]; an empty split has -inf."""
    weights = torch.softmax(lse, dim=-1)   # split 0 always has keys, so no row is all -inf
    return (out * weights.unsqueeze(-1)).sum(dim=2)
