"""The paged KV cache: one pool of fixed-size blocks per layer, allocated once."""
from __future__ import annotations

import torch


class KVCache:
    """k and v: [layers, num_blocks, kv_heads, block_size, head_dim].

    A token's slot is block_id * block_size + offset; the block manager decides which
    block ids a sequence owns. Sized once from the memory budget and never reallocated.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                 num_blocks: int, dtype: torch.dtype, device: torch.device):
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_layers, num_blocks, num_kv_heads, block_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    @classmethod
    def blocks_for_budget(cls, budget_bytes: float, num_layers: int, num_kv_heads: int,
                          head_dim: int, block_size: int, dtype: torch.dtype) -> int:
        per_block = cls.bytes_per_block(num_layers, num_kv_heads, head_dim, block_size, dtype)
        num_blocks = int(budget_bytes // per_block)
        if num_blocks < 1:
            raise ValueError(f"a KV-cache budget of {budget_bytes / 2**20:.1f} MiB holds no block "
                             f"({per_block / 2**20:.2f} MiB each); raise kv_cache_gib")
        return num_blocks

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
