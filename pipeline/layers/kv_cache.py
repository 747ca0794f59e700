"""The paged KV cache: one pool of fixed-size blocks per layer, allocated once."""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14


class KVCache:
    """k and v: [layers, *layer_shape], the layer shape given by the attention backend
    (pipeline/layers/attention): [num_blocks + 1, kv_heads, block_size, head_dim] for the
    cpu backend, [num_blocks + 1, block_size, kv_heads, head_dim] for the varlen ones.

    A token's slot is block_id * block_size + offset; the block manager decides which
    block ids a sequence owns, among 0 .. num_blocks - 1. One more block, `pad_block`
    (= num_blocks), is never handed out: padding rows (CUDA graphs of bucketed decode
    batches) write their keys there and block tables are padded with it. Sized once from
    the memory budget and never reallocated.
    dtype is the compute dtype, or torch.int8 for an INT8 cache (cpu backend): then k_scale
    and v_scale [layers, num_blocks + 1, kv_heads, block_size] float32 hold each token's and
    head's scale (layers/quantization/int8_kv_cache.py); otherwise they are None.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                 num_blocks: int, dtype: torch.dtype, device: torch.device, backend=None):
        if backend is None:
            from pipeline.layers.attention.cpu import CpuBackend
            backend = CpuBackend()
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.pad_block = num_blocks
        self.num_kv_heads = num_kv_heads
        self.dtype = dtype
        shape = (num_layers, *backend.layer_cache_shape(num_blocks + 1, num_kv_heads, block_size, head_dim))
        self.k = _zeros_on_huge_pages(shape, dtype, device)
        self.v = _zeros_on_huge_pages(shape, dtype, device)
        self.k_scale = self.v_scale = None
        if dtype == torch.int8:
            self.k_scale = _zeros_on_huge_pages(shape[:-1], torch.float32, device)
            self.v_scale = _zeros_on_huge_pages(shape[:-1], torch.float32, device)

    def layer(self, i: int):
        """Layer i's cache, as the attention backends take it."""
        from pipeline.layers.attention import LayerCache
        if self.k_scale is None:
            return LayerCache(self.k[i], self.v[i])
        return LayerCache(self.k[i], self.v[i], self.k_scale[i], self.v_scale[i])

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy blocks (source, destination) in every layer, scales included; every source is
        read before any destination is written."""
        source = torch.tensor([src for src, _ in copies], device=self.k.device)
        destination = torch.tensor([dst for _, dst in copies], device=self.k.device)
        for pool in (self.k, self.v, self.k_scale, self.v_scale):
            if pool is not None:
                pool.index_copy_(1, destination, pool.index_select(1, source))

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                        dtype: torch.dtype) -> int:
        per_token_head = head_dim * dtype.itemsize
        if dtype == torch.int8:
            per_token_head += torch.float32.itemsize   # its scale
        return 2 * num_layers * block_size * num_kv_heads * per_token_head

    @classmethod
    def blocks_for_budget(cls, budget_bytes: float, num_layers: int, num_kv_heads: int,
                          head_dim: int, block_size: int, dtype: torch.dtype) -> int:
        per_block = cls.bytes_per_block(num_layers, num_kv_heads, head_dim, block_size, dtype)
        num_blocks = int(budget_bytes // per_block)
        if num_blocks < 1:
            raise ValueError(f"a KV-cache budget of {budget_bytes / 2**20:.1f} MiB holds no block "
                             f"({per_block / 2**20:.2f} MiB each); raise kv_cache_gib")
        return num_blocks


def _zeros_on_huge_pages(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros, but on Linux CPUs backed by 2 MiB pages where the kernel allows it.

    Decode attention reads each sequence's blocks from all over the pool; with 4 KiB pages
    nearly every block read is a TLB miss. Asking for transparent huge pages before the
    memory is first touched made the decode attention kernel ~12% faster here."""
    if device.type != "cpu" or not sys.platform.startswith("linux"):
        return torch.zeros(shape, dtype=dtype, device=device)
    t = torch.empty(shape, dtype=dtype, device=device)
    start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (t.data_ptr() + t.nbytes) // HUGE_PAGE * HUGE_PAGE
    if end > start:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
            libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE)
        except (OSError, AttributeError):
            pass   # only a hint: without it the cache is the same, just on small pages
    return t.zero_()
