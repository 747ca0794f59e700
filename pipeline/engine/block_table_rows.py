"""Every block-holding sequence's block table, mirrored as a row of one int32 array.

A step's attention reads its sequences' block tables as one [seqs, pages] array. Built
from the lists every step, that converts every block id of every sequence again (0.29 ms
at 256 sequences of 40 blocks, the 128 + 512-token decode of issue 28, 0.15 ms at 16
blocks); kept here as the block manager changes the lists, a step takes its rows with
one numpy index (0.02 ms). The block manager is the only writer: it writes a row when it
gives a sequence blocks (appended, or a copy on write swapped in) or shares a parent's,
and releases it when the sequence lets go of its blocks. A row's entries past its
table's length are stale and never read: a step reads only the blocks its tokens reach,
all of which the sequence holds.
"""
from __future__ import annotations

import numpy as np

from pipeline.engine.sequence import Sequence


class BlockTableRows:
    def __init__(self, rows: int = 64, width: int = 64):
        self.array = np.zeros((rows, width), dtype=np.int32)
        self.free_rows = list(range(rows - 1, -1, -1))   # lowest first

    def write(self, seq: Sequence, start: int = 0) -> None:
        """Mirror seq.block_table[start:] into seq's row, giving it a row if it has none."""
        table = seq.block_table
        if seq.table_row is None:
            if not self.free_rows:
                self._grow(rows=2 * len(self.array))
            seq.table_row = self.free_rows.pop()
            start = 0
        if len(table) > self.array.shape[1]:
            self._grow(width=max(len(table), 2 * self.array.shape[1]))
        if start < len(table):
            self.array[seq.table_row, start:len(table)] = table[start:]

    def release(self, seq: Sequence) -> None:
        """seq holds no blocks any more: its row goes back to the free rows."""
        if seq.table_row is not None:
            self.free_rows.append(seq.table_row)
            seq.table_row = None

    def gather(self, rows: list[int], used: np.ndarray, pad_block: int) -> np.ndarray:
        """The [len(rows), max(used)] block tables of these rows, each row's first used[i]
        entries and pad_block after them."""
        width = int(used.max())
        tables = self.array[rows, :width]   # a copy: fancy indexing
        tables[np.arange(width) >= used[:, None]] = pad_block
        return tables

    def _grow(self, rows: int | None = None, width: int | None = None) -> None:
        old_rows, old_width = self.array.shape
        rows, width = rows or old_rows, width or old_width
        array = np.zeros((rows, width), dtype=np.int32)
        array[:old_rows, :old_width] = self.array
        self.array = array
        self.free_rows[:0] = range(rows - 1, old_rows - 1, -1)   # taken after the ones freed before
