"""Varlen attention over a paged cache: one call per layer for the whole packed batch.

Each scheduled sequence is one query of `query_lens[i]` rows (1 for a decode, 1 + K for a
decode with drafts, n for a prefill chunk) against the first `seqused_k[i]` keys of its
pages (`block_table[i]`); the causal mask is aligned to the bottom right, so query row j
sees the keys up to position seqused_k - query_len + j, which is exactly what decodes,
speculative rows and chunks with a cached prefix need.

Layout per layer: [num_blocks, block_size, kv_heads, head_dim] (FlashAttention's "pages").

- VarlenBackend: torch.nn.attention.varlen.varlen_attn(..., block_table=, seqused_k=),
  FlashAttention-2 inside PyTorch (torch >= 2.12; flash_entry.py): CUDA, float16/bfloat16,
  block size a multiple of 256 (flash_api.cpp: "Paged KV cache block size must be
  divisible by 256"). torch 2.10/2.11 have no block_table: varlen_packed.py gathers the
  pages for them.
- ReferenceVarlenBackend: the same semantics in plain PyTorch, any device, dtype and block
  size. Neither reads anything back to the host in its forward (max_q and max_k are host
  ints from the layout), so both can be captured in a CUDA graph and traced whole.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.kernels import cuda_kernels
from pipeline.layers.attention import AttentionBackend, HostToDevice, LayerCache, StepLayout
from pipeline.layers.attention.flash_entry import causal_window, installed_varlen_attn


@dataclass(slots=True)
class VarlenMetadata:
    slot_mapping: torch.Tensor   # [tokens] int64, where each new token's keys go (block * block_size + offset)
    cu_seq_q: torch.Tensor       # [seqs + 1] int32, query rows of sequence i: cu_seq_q[i]:cu_seq_q[i + 1]
    cu_seq_k: torch.Tensor       # [seqs + 1] int32, cumulative seqused_k
    seqused_k: torch.Tensor      # [seqs] int32, keys sequence i attends to (its new ones included)
    block_table: torch.Tensor    # [seqs, max_pages] int32, its pages in order (padded with the pad block)
    max_q: int
    max_k: int


def varlen_arrays(layout: StepLayout) -> dict[str, np.ndarray]:
    """The varlen metadata of a step, on the host."""
    cu_q = np.zeros(layout.num_seqs + 1, dtype=np.int32)
    np.cumsum(layout.query_lens, out=cu_q[1:])
    cu_k = np.zeros(layout.num_seqs + 1, dtype=np.int32)
    np.cumsum(layout.context_lens, out=cu_k[1:])
    return dict(slot_mapping=layout.slot_mapping, cu_seq_q=cu_q, cu_seq_k=cu_k,
                seqused_k=layout.context_lens.astype(np.int32), block_table=layout.block_tables)


class ReferenceVarlenBackend(AttentionBackend):
    name = "reference"
    default_block_size = 16
    supports_cuda_graphs = True

    def layer_cache_shape(self, num_blocks, num_kv_heads, block_size, head_dim):
        return (num_blocks, block_size, num_kv_heads, head_dim)

    def build_metadata(self, layout: StepLayout, num_kv_heads: int, to_device: HostToDevice) -> VarlenMetadata:
        arrays = {name: to_device(name, a) for name, a in varlen_arrays(layout).items()}
        return VarlenMetadata(**arrays, max_q=int(layout.query_lens.max()), max_k=int(layout.context_lens.max()))

    def rotary_write_kv(self, qkv, rotation, meta: VarlenMetadata, cache: LayerCache, num_heads, num_kv_heads) -> bool:
        """On CUDA, the fused Triton kernel (kernels/pointwise_triton.py): q and k rotated in
        place, k and v stored at their slots, in one launch instead of five."""
        fused = cuda_kernels.triton_pointwise(qkv, cache.k)
        if fused is None or not (cache.k.is_contiguous() and cache.v.is_contiguous()):
            return False
        fused.rotary_write_kv(qkv, rotation.cos, rotation.sin, meta.slot_mapping, cache.k, cache.v, num_heads,
                              num_kv_heads)
        return True

    def write_kv(self, cache: LayerCache, k, v, meta: VarlenMetadata) -> None:
        cache.k.view(-1, *cache.k.shape[2:]).index_copy_(0, meta.slot_mapping, k)
        cache.v.view(-1, *cache.v.shape[2:]).index_copy_(0, meta.slot_mapping, v)

    def forward(self, q, k, v, cache: LayerCache, meta: VarlenMetadata, scale):
        """Every query padded to max_q rows, every sequence's pages gathered: [seqs, max_q,
        max_pages * block_size] scores in float32, the softmax masked by causality and
        seqused_k; rows past a query's length are dropped."""
        tokens, num_heads, head_dim = q.shape
        num_seqs, num_kv_heads = meta.seqused_k.shape[0], cache.k.shape[2]
        group = num_heads // num_kv_heads
        keys = cache.k[meta.block_table].flatten(1, 2).float()            # [seqs, keys, kv_heads, head_dim]
        values = cache.v[meta.block_table].flatten(1, 2).float()
        q_lens = meta.cu_seq_q[1:] - meta.cu_seq_q[:-1]                    # [seqs]
        j = torch.arange(meta.max_q, device=q.device)
        q_valid = j < q_lens.unsqueeze(1)                                  # [seqs, max_q]
        q_index = (meta.cu_seq_q[:-1].unsqueeze(1) + j).clamp(max=tokens - 1)
        queries = (q[q_index].float() * scale).view(num_seqs, meta.max_q, num_kv_heads, group, head_dim)
        # Bottom-right causal: row j sees keys [0, seqused_k - q_len + j].
        limit = (meta.seqused_k - q_lens).unsqueeze(1) + j + 1            # [seqs, max_q]
        visible = torch.arange(keys.shape[1], device=q.device) < limit.clamp(min=1).unsqueeze(-1)
        scores = torch.einsum("sqhgd,skhd->shgqk", queries, keys)
        scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
        out = torch.einsum("shgqk,skhd->sqhgd", scores.softmax(dim=-1), values)
        # Scatter the valid rows back to their packed positions; padded rows land in a spare row.
        target = torch.where(q_valid, q_index, tokens).flatten()
        packed = q.new_zeros((tokens + 1, num_heads, head_dim))
        packed.index_copy_(0, target, out.reshape(-1, num_heads, head_dim).to(q.dtype))
        return packed[:tokens]


def check_flash(dtype: torch.dtype, device: torch.device) -> None:
    """FlashAttention-2 runs on CUDA in float16 or bfloat16 only."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        raise ValueError("the varlen attention backend (FlashAttention-2) runs on CUDA in float16 or "
                         f"bfloat16 only, not {device.type} {str(dtype).removeprefix('torch.')}; "
                         "use attention_backend 'reference' or 'cpu'")


class VarlenBackend(ReferenceVarlenBackend):
    name = "varlen"
    default_block_size = 256
    PAGE_MULTIPLE = 256   # FlashAttention-2's paged KV (flash_api.cpp, mha_varlen_fwd)

    def __init__(self, kernel=None):
        self.kernel = kernel or installed_varlen_attn()   # one with block_table (flash_entry.PAGED)

    def check(self, block_size, dtype, kv_dtype, device) -> None:
        super().check(block_size, dtype, kv_dtype, device)
        check_flash(dtype, device)
        if block_size % self.PAGE_MULTIPLE:
            raise ValueError(f"the varlen attention backend needs a block_size divisible by {self.PAGE_MULTIPLE} "
                             f"(FlashAttention-2's paged KV cache), got {block_size}")

    def forward(self, q, k, v, cache: LayerCache, meta: VarlenMetadata, scale):
        return self.kernel(q, cache.k, cache.v, meta.cu_seq_q, meta.cu_seq_k, meta.max_q, meta.max_k,
                           scale=scale, window_size=causal_window(meta.max_q), enable_gqa=True,
                           seqused_k=meta.seqused_k, block_table=meta.block_table)
