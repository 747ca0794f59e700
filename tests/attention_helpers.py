"""Helpers of the attention-backend tests: a hand-made mixed batch, a runner over one layer,
and torch's two varlen_attn signatures as plain-PyTorch stand-ins for FlashAttention-2."""
from __future__ import annotations

import types

import torch

from pipeline.engine.model_runner import ModelRunner
from pipeline.engine.sequence import Sequence
from pipeline.layers.kv_cache import KVCache
from pipeline.sampling_params import SamplingParams as Params

CPU = torch.device("cpu")
BS = 4            # block size of the hand-made batch
NUM_BLOCKS = 12   # the pad block is 12


def seq(name: str, num_tokens: int, computed: int, table: list[int], drafts: list[int] = ()) -> Sequence:
    s = Sequence(name, list(range(100, 100 + num_tokens)), Params(), None)
    s.num_computed_tokens = computed
    s.block_table = list(table)
    s.draft_token_ids = list(drafts)
    return s


def hand_made_batch():
    """In packed order: a decode, a decode with 2 drafts, a fresh prefill, a chunk after 8
    cached tokens. (sequences, tokens each computes)."""
    return ([seq("decode", 5, 4, [7, 3]),                     # row 0, position 4 in block 3
             seq("drafts", 7, 6, [1, 9, 2], drafts=[55, 56]),  # rows 1-3, positions 6, 7, 8
             seq("fresh", 5, 0, [4, 5]),                      # rows 4-8, positions 0-4
             seq("chunk", 20, 8, [6, 0, 8, 10, 11])],         # rows 9-11, positions 8-10
            [1, 3, 5, 3])


def runner_for(backend, num_kv_heads=2, head_dim=16, dtype=torch.float32):
    kv = KVCache(1, num_kv_heads, head_dim, BS, NUM_BLOCKS, dtype, CPU, backend)
    model = types.SimpleNamespace(model=types.SimpleNamespace(layers=[]))
    return ModelRunner(model, kv, CPU, backend), kv


def packed_attention(query, key, value, cu_seq_q, cu_seq_k, scale, causal, top_left=False):
    """FlashAttention-2's varlen semantics, one sequence at a time: packed keys, query heads
    grouped over KV heads, the causal mask aligned bottom right (top_left: as SDPA's
    is_causal aligns it, wrong for a chunk after cached keys)."""
    out = torch.empty_like(query)
    group = query.shape[1] // key.shape[1]
    for i in range(len(cu_seq_q) - 1):
        q0, q1, k0, k1 = int(cu_seq_q[i]), int(cu_seq_q[i + 1]), int(cu_seq_k[i]), int(cu_seq_k[i + 1])
        q = query[q0:q1].float()
        k = key[k0:k1].float().repeat_interleave(group, dim=1)
        v = value[k0:k1].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if causal:
            offset = 0 if top_left else (k1 - k0) - (q1 - q0)
            visible = torch.arange(k1 - k0)[None] <= torch.arange(q1 - q0)[:, None] + offset
            scores = scores.masked_fill(~visible, float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(query.dtype)
    return out


def varlen_attn_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                     window_size=(-1, -1)):
    """torch 2.11's signature (torch/nn/attention/varlen.py of the 2.11.0 wheel), its math in
    PyTorch; records the windows it is called with."""
    varlen_attn_2_11.windows.append(tuple(window_size))
    assert isinstance(max_q, int) and isinstance(max_k, int)
    assert max_q == int((cu_seq_q[1:] - cu_seq_q[:-1]).max()) and max_k == int((cu_seq_k[1:] - cu_seq_k[:-1]).max())
    return packed_attention(query, key, value, cu_seq_q, cu_seq_k, scale, tuple(window_size) == (-1, 0))


varlen_attn_2_11.windows = []


def varlen_attn_2_12(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                     window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """torch 2.12's signature (2.13's too), paged: each sequence's first seqused_k keys of its pages."""
    assert enable_gqa or query.shape[1] == key.shape[-2]
    if block_table is not None:
        block_size = key.shape[1]
        slots = [int(block_table[i, p // block_size]) * block_size + p % block_size
                 for i in range(len(seqused_k)) for p in range(int(seqused_k[i]))]
        key, value = key.flatten(0, 1)[slots], value.flatten(0, 1)[slots]
        cu_seq_k = torch.nn.functional.pad(seqused_k.cumsum(0), (1, 0))
    return packed_attention(query, key, value, cu_seq_q, cu_seq_k, scale, tuple(window_size) == (-1, 0))


def top_left_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                         window_size=(-1, -1)):
    """2.11's signature with the causal mask aligned top left: what the probe must refuse."""
    return packed_attention(query, key, value, cu_seq_q, cu_seq_k, scale, tuple(window_size) == (-1, 0), top_left=True)


def next_decode_layout(engine, requests):
    """Add requests, run their prefills (one step), and lay out the next step, in which
    every one of them decodes a token: (its batch, its StepLayout)."""
    for request in requests:
        engine.add_request(request)
    engine.step()   # the prefills; the next step decodes all of them
    engine.step()
    batch = engine.scheduler.schedule()
    layout = engine.runner._prepare(batch.seqs, batch.num_new_tokens)
    assert layout.is_plain_decode and layout.num_seqs == len(requests)
    return batch, layout
