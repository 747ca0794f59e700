"""BlockManager: torch-free bookkeeping of the paged KV cache's blocks."""
from __future__ import annotations

import pytest

from pipeline.block_manager import BlockManager
from pipeline.detokenizer import IncrementalDetokenizer
from pipeline.sampling_params import SamplingParams
from pipeline.sequence import Sequence


def make_seq(request_id: str = "s", num_prompt_tokens: int = 4) -> Sequence:
    ids = list(range(10, 10 + num_prompt_tokens))
    return Sequence(request_id, ids, SamplingParams(), IncrementalDetokenizer(None, ids, []))


def test_starts_empty():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.num_free_blocks == 8
    assert bm.utilization == 0.0
    assert sorted(bm.free_block_ids) == list(range(8))


@pytest.mark.parametrize("tokens, blocks", [(0, 0), (1, 1), (4, 1), (5, 2), (8, 2), (9, 3), (33, 9)])
def test_blocks_needed_rounds_up(tokens, blocks):
    assert BlockManager(num_blocks=100, block_size=4).blocks_needed(tokens) == blocks


def test_allocate_grows_block_table_incrementally():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq()
    bm.allocate(seq, 3)
    assert len(seq.block_table) == 1
    bm.allocate(seq, 4)                       # still fits in the first block
    assert len(seq.block_table) == 1
    bm.allocate(seq, 9)                       # 3 blocks in total
    assert len(seq.block_table) == 3
    assert len(set(seq.block_table)) == 3
    assert bm.num_free_blocks == 5
    assert bm.utilization == pytest.approx(3 / 8)
    bm.allocate(seq, 2)                       # never shrinks
    assert len(seq.block_table) == 3


def test_can_allocate_counts_blocks_already_held():
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = make_seq("a"), make_seq("b")
    bm.allocate(a, 8)                         # 2 blocks, 2 free
    assert bm.can_allocate(a, 16)             # needs only 2 more
    assert not bm.can_allocate(a, 17)         # would need 3 more
    assert bm.can_allocate(b, 8)
    assert not bm.can_allocate(b, 9)


def test_allocate_past_the_pool_raises_without_partial_allocation():
    bm = BlockManager(num_blocks=3, block_size=4)
    seq = make_seq()
    with pytest.raises(RuntimeError, match="out of blocks"):
        bm.allocate(seq, 13)
    assert seq.block_table == []
    assert bm.num_free_blocks == 3


def test_blocks_are_never_shared_and_free_returns_them():
    bm = BlockManager(num_blocks=10, block_size=2)
    seqs = [make_seq(str(i)) for i in range(3)]
    for seq, n in zip(seqs, (5, 6, 4)):      # 3 + 3 + 2 blocks
        bm.allocate(seq, n)
    owned = [b for s in seqs for b in s.block_table]
    assert len(owned) == len(set(owned)) == 8
    assert set(owned).isdisjoint(bm.free_block_ids)
    assert bm.utilization == pytest.approx(0.8)

    bm.free(seqs[1])
    assert seqs[1].block_table == []
    assert bm.num_free_blocks == 5
    # Freed blocks are handed out again, still without sharing.
    late = make_seq("late")
    bm.allocate(late, 10)
    owned = [b for s in (seqs[0], seqs[2], late) for b in s.block_table]
    assert len(owned) == len(set(owned)) == 10
    assert bm.num_free_blocks == 0
    assert bm.utilization == 1.0
    for seq in (seqs[0], seqs[2], late):
        bm.free(seq)
    assert sorted(bm.free_block_ids) == list(range(10))
    assert bm.utilization == 0.0


def test_free_of_a_sequence_without_blocks_is_harmless():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq()
    bm.free(seq)
    bm.free(seq)
    assert bm.num_free_blocks == 2
