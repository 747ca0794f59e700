"""Which FlashAttention varlen entry point the installed PyTorch has, read from its signature.

`torch.nn.attention.varlen.varlen_attn` (FlashAttention-2 inside PyTorch) is called in two shapes:
- torch 2.10 and 2.11: `varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *,
  return_aux, scale, window_size)`. Keys and values must be contiguous: each sequence's
  keys back to back, `cu_seq_k` apart (PACKED). Fewer key/value heads than query heads go
  through as they are: FlashAttention-2's mha_varlen_fwd takes any that divide them.
- torch 2.12 and later add `enable_gqa`, `seqused_k` and `block_table` (and `num_splits`):
  the paged cache is read in place (PAGED). They refuse grouped-query attention unless
  `enable_gqa=True`.
torch 2.9's takes `is_causal` instead of `scale` and `window_size`, and older torch has no
such module: both None, and the engine then uses PyTorch paths (choice.py).
The shape is read with inspect.signature, never from the version string, so a torch
whose function changes is caught by tests/layers/test_flash_entry.py on any machine.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable

PAGED = "paged"
PACKED = "packed"
# Every call we make passes these; without them the function is not one we can call.
CALLED_PARAMS = frozenset({"query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "scale",
                           "window_size"})
PAGED_PARAMS = frozenset({"block_table", "seqused_k", "enable_gqa"})


def installed_varlen_attn() -> Callable | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:   # torch < 2.9
        return None
    return varlen_attn


def entry_kind(fn: Callable | None) -> str | None:
    """PAGED, PACKED, or None when fn is missing or takes arguments we do not know how to give."""
    params = _params(fn)
    if params is None or not CALLED_PARAMS <= params:
        return None
    return PAGED if PAGED_PARAMS <= params else PACKED


def gqa_kwargs(fn: Callable) -> dict:
    """enable_gqa=True where the function takes it (2.12+ refuses GQA without it); 2.11 has no such flag."""
    return {"enable_gqa": True} if "enable_gqa" in (_params(fn) or ()) else {}


def causal_window(max_q: int) -> tuple[int, int]:
    """(-1, 0) is causal, aligned bottom right. When every query of the step is one row,
    each sees all its keys anyway, and (-1, -1) lets FlashAttention-2 fold a KV head's
    query heads into rows (mha_varlen_fwd's seqlenq_ngroups_swapped needs window_size_right
    < 0): each KV page is then read once per KV head, not once per query head."""
    return (-1, -1) if max_q == 1 else (-1, 0)


def _params(fn: Callable | None) -> frozenset | None:
    if fn is None:
        return None
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):   # a builtin without a signature
        return None
