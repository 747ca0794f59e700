"""Hands out fixed-size KV-cache blocks to sequences and takes them back.

Torch-free bookkeeping over the pool that `kv_cache.KVCache` preallocates: a block id
is an index into that pool. Blocks are returned when a sequence finishes, is cancelled
or is preempted; nothing is ever reallocated.
"""
from __future__ import annotations

from collections import deque

from pipeline.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def utilization(self) -> float:
        """Fraction of the pool in use (used / total blocks)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `seq` can hold `num_tokens` tokens in total."""
        return self.blocks_needed(num_tokens) - len(seq.block_table) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow seq's block table to hold `num_tokens` tokens (call can_allocate first)."""
        missing = self.blocks_needed(num_tokens) - len(seq.block_table)
        if missing > self.num_free_blocks:
            raise RuntimeError("KV cache out of blocks: call can_allocate first")
        for _ in range(missing):
            seq.block_table.append(self.free_block_ids.popleft())

    def free(self, seq: Sequence) -> None:
        self.free_block_ids.extend(seq.block_table)
        seq.block_table.clear()
