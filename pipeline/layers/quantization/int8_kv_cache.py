"""INT8 KV cache: keys and values stored as int8 with one float32 scale per token and kv head.

Quantized when written (symmetric, scale = max|x| / 127 over the head's head_dim values,
round half to even), dequantized when attention reads them: the C decode kernel widens
the int8 rows in registers; the PyTorch paths here dequantize the blocks they gather.

Per token and head rather than per block and head: a token's scale is fixed when it is
written, so appending to a block never requantizes the tokens already in it, and one
outlier token cannot flatten its block's other 15. The scales cost 4 bytes per 64
int8 values (head_dim 64), ~6%.
"""
from __future__ import annotations

import torch


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (int8 [..., head_dim], float32 scales [...]); x ~= x8 * scale.
    The same float32 operations as the C kernel (rotary_cache.c), so both store the same bytes."""
    x = x.float()
    amax = x.abs().amax(dim=-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    x8 = torch.round(x * inv.unsqueeze(-1)).to(torch.int8)
    return x8, amax * (1.0 / 127.0)   # as the C kernel: times the float32 reciprocal


def dequantize(x8: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 [..., head_dim] and scales [...] -> dtype [..., head_dim]."""
    return (x8.float() * scales.unsqueeze(-1)).to(dtype)


def write_kv_int8(cache: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor, x: torch.Tensor) -> None:
    """Quantize x [tokens, kv_heads, head_dim] into cache [blocks, kv_heads, block_size, head_dim]
    (int8) and scales [blocks, kv_heads, block_size] at rows (see attention.cache_rows)."""
    x8, s = quantize(x.reshape(-1, cache.shape[-1]))
    cache.view(-1, cache.shape[-1]).index_copy_(0, rows, x8)
    scales.view(-1).index_copy_(0, rows, s)
