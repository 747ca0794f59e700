"""BlockManager: torch-free bookkeeping of the paged KV cache's blocks, and the prefix cache."""
from __future__ import annotations

import random

import pytest

from pipeline.engine.block_manager import BlockManager, block_hash
from pipeline.engine.block_table_rows import BlockTableRows
from pipeline.engine.detokenizer import IncrementalDetokenizer
from pipeline.sampling_params import SamplingParams
from pipeline.engine.sequence import Sequence


def make_seq(request_id: str = "s", num_prompt_tokens: int = 4, ids: list[int] | None = None) -> Sequence:
    ids = list(range(10, 10 + num_prompt_tokens)) if ids is None else ids
    return Sequence(request_id, ids, SamplingParams(), IncrementalDetokenizer(None, ids, []))


def admit(bm: BlockManager, seq: Sequence, num_tokens: int | None = None) -> int:
    """What the scheduler does on admission: take the cached prefix, allocate the rest.
    Returns the number of cached tokens."""
    cached = bm.find_cached_prefix(seq)
    assert bm.try_allocate(seq, seq.num_tokens if num_tokens is None else num_tokens, cached)
    return len(cached) * bm.block_size


def check_accounting(bm: BlockManager, holders: list[Sequence]) -> None:
    """Every block is exactly one of: held (ref count = its holders), plain free, cached free."""
    refs = {}
    for seq in holders:
        for b in seq.block_table:
            refs[b] = refs.get(b, 0) + 1
    for block in bm.blocks:
        assert block.ref_count == refs.get(block.block_id, 0)
    free, cached_free = set(bm.free_block_ids), set(bm.cached_free_block_ids)
    assert free.isdisjoint(cached_free) and free.isdisjoint(refs) and cached_free.isdisjoint(refs)
    assert len(free) + len(cached_free) + len(refs) == bm.num_blocks, "blocks leaked"
    for h, b in bm.cached_block_ids.items():
        assert bm.blocks[b].hash == h
    assert all(bm.blocks[b].hash is None for b in free)
    # The model runner's array rows mirror every holder's table, one row each.
    for seq in holders:
        if seq.block_table:
            assert bm.table_rows.array[seq.table_row, :len(seq.block_table)].tolist() == seq.block_table
        else:
            assert seq.table_row is None
    held_rows = [seq.table_row for seq in holders if seq.block_table]
    assert len(set(held_rows)) == len(held_rows)
    assert sorted(held_rows + bm.table_rows.free_rows) == list(range(len(bm.table_rows.array))), "rows leaked"


# ---- plain allocation ---------------------------------------------------------------------

def test_starts_empty():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.num_free_blocks == 8
    assert bm.utilization == 0.0
    assert bm.num_cached_blocks == 0
    assert sorted(bm.free_block_ids) == list(range(8))


@pytest.mark.parametrize("tokens, blocks", [(0, 0), (1, 1), (4, 1), (5, 2), (8, 2), (9, 3), (33, 9)])
def test_blocks_needed_rounds_up(tokens, blocks):
    assert BlockManager(num_blocks=100, block_size=4).blocks_needed(tokens) == blocks


def test_try_allocate_grows_block_table_incrementally():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq()
    assert bm.try_allocate(seq, 3)
    assert len(seq.block_table) == 1
    assert bm.try_allocate(seq, 4)            # still fits in the first block
    assert len(seq.block_table) == 1
    assert bm.try_allocate(seq, 9)            # 3 blocks in total
    assert len(seq.block_table) == 3
    assert len(set(seq.block_table)) == 3
    assert bm.num_free_blocks == 5
    assert bm.utilization == pytest.approx(3 / 8)
    assert bm.try_allocate(seq, 2)            # never shrinks
    assert len(seq.block_table) == 3


def test_try_allocate_counts_blocks_already_held_and_changes_nothing_when_short():
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = make_seq("a"), make_seq("b")
    assert bm.try_allocate(a, 8)              # 2 blocks, 2 free
    assert not bm.try_allocate(a, 17)         # would need 3 more
    assert len(a.block_table) == 2 and bm.num_free_blocks == 2
    assert bm.try_allocate(a, 16)             # needs only 2 more
    assert not bm.try_allocate(b, 1)
    assert b.block_table == []


def test_without_caching_blocks_are_never_shared_and_free_returns_them():
    bm = BlockManager(num_blocks=10, block_size=2)
    seqs = [make_seq(str(i)) for i in range(3)]          # identical prompts
    for seq, n in zip(seqs, (5, 6, 4)):                  # 3 + 3 + 2 blocks
        assert admit(bm, seq, n) == 0
    owned = [b for s in seqs for b in s.block_table]
    assert len(owned) == len(set(owned)) == 8
    assert bm.num_cached_blocks == 0
    bm.free(seqs[1])
    assert seqs[1].block_table == []
    assert bm.num_free_blocks == 5
    check_accounting(bm, [seqs[0], seqs[2]])
    for seq in (seqs[0], seqs[2]):
        bm.free(seq)
    assert sorted(bm.free_block_ids) == list(range(10))
    assert bm.utilization == 0.0


def test_free_of_a_sequence_without_blocks_is_harmless():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq()
    bm.free(seq)
    bm.free(seq)
    assert bm.num_free_blocks == 2


# ---- prefix caching -----------------------------------------------------------------------

def cached_bm(num_blocks=16, block_size=4) -> BlockManager:
    return BlockManager(num_blocks, block_size, enable_prefix_caching=True)


def test_hash_chain_depends_on_the_parent():
    tokens = [1, 2, 3, 4]
    assert block_hash(None, tokens) == block_hash(None, list(tokens))
    assert block_hash(None, tokens) != block_hash(block_hash(None, [9, 9, 9, 9]), tokens)
    assert block_hash(None, tokens) != block_hash(None, [1, 2, 3, 5])
    # The same second block after a different first block does not match.
    bm = cached_bm()
    a = make_seq("a", ids=[1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(bm, a)
    b = make_seq("b", ids=[0, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.find_cached_prefix(b) == []
    c = make_seq("c", ids=[1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert bm.find_cached_prefix(c) == a.block_table[:2]


def test_shared_prefix_is_reference_counted():
    bm = cached_bm()
    a = make_seq("a", ids=list(range(10)))                 # blocks [0..3] [4..7] and a partial one
    assert admit(bm, a) == 0
    assert bm.num_cached_blocks == 2                       # only full blocks are findable
    b = make_seq("b", ids=list(range(8)) + [50, 51, 52, 53])
    assert admit(bm, b) == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]            # the partial block is never shared
    assert bm.blocks[a.block_table[0]].ref_count == 2
    check_accounting(bm, [a, b])

    bm.free(a)                                             # b still holds the shared blocks
    assert bm.blocks[b.block_table[0]].ref_count == 1
    check_accounting(bm, [b])
    bm.free(b)                                             # all free; the full ones still cached
    check_accounting(bm, [])
    assert bm.num_free_blocks == 16 and bm.utilization == 0.0
    assert len(bm.cached_free_block_ids) == bm.num_cached_blocks == 3   # a's 2 + b's own full block


def test_at_least_one_token_is_always_computed():
    bm = cached_bm()
    a = make_seq("a", ids=list(range(8)))                  # exactly two full blocks
    admit(bm, a)
    b = make_seq("b", ids=list(range(8)))
    assert admit(bm, b) == 4                               # the last block is computed again
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    check_accounting(bm, [a, b])


def test_output_tokens_fill_blocks_that_become_findable():
    bm = cached_bm()
    a = make_seq("a", ids=[1, 2, 3])
    admit(bm, a)
    a.output_token_ids += [4, 5]                           # decoding: block 0 is full now
    assert bm.try_allocate(a, 5)
    assert bm.num_cached_blocks == 1
    b = make_seq("b", ids=[1, 2, 3, 4, 9])
    assert bm.find_cached_prefix(b) == a.block_table[:1]


def test_cached_free_blocks_are_evicted_least_recently_used_first_and_only_when_needed():
    bm = cached_bm(num_blocks=6, block_size=2)
    old = make_seq("old", ids=[1, 1, 2, 2, 3])             # 2 full blocks + a partial one
    new = make_seq("new", ids=[7, 7, 8, 8, 9])
    admit(bm, old)
    admit(bm, new)
    bm.free(old)
    bm.free(new)
    assert len(bm.free_block_ids) == 2 and len(bm.cached_free_block_ids) == 4
    order = list(bm.cached_free_block_ids)
    # Freed tail first, oldest holder first: old's second block is the first to go.
    assert order == [bm.cached_block_ids[old.block_hashes[1]],
                     bm.cached_block_ids[old.block_hashes[0]],
                     bm.cached_block_ids[new.block_hashes[1]],
                     bm.cached_block_ids[new.block_hashes[0]]]

    x = make_seq("x", ids=[0] * 7)                         # 4 blocks: 2 plain free, then 2 evicted
    admit(bm, x)
    check_accounting(bm, [x])
    assert bm.find_cached_prefix(make_seq("o", ids=[1, 1, 2, 2, 3])) == []      # old's evicted
    assert len(bm.find_cached_prefix(make_seq("n", ids=[7, 7, 8, 8, 9]))) == 2   # new's kept


def test_a_cache_hit_refreshes_and_holds_free_cached_blocks():
    bm = cached_bm(num_blocks=4, block_size=2)
    a = make_seq("a", ids=[1, 1, 2, 2, 3])
    admit(bm, a)
    bm.free(a)                                             # 2 cached free, 2 plain free
    b = make_seq("b", ids=[1, 1, 2, 2, 5, 5, 6])           # hits 2, needs 2 more: exactly fits
    cached = bm.find_cached_prefix(b)
    assert len(cached) == 2
    assert bm.try_allocate(b, b.num_tokens, cached)
    assert bm.num_free_blocks == 0
    check_accounting(bm, [b])
    c = make_seq("c", ids=[1, 1, 9])
    # A hit on blocks already held costs no free block; nothing else is left.
    assert bm.try_allocate(c, 2, bm.find_cached_prefix(c))
    assert not bm.try_allocate(c, 3)
    check_accounting(bm, [b, c])


def test_a_hit_needing_more_than_is_free_takes_nothing():
    bm = cached_bm(num_blocks=3, block_size=2)
    a = make_seq("a", ids=[1, 1, 2])
    admit(bm, a)
    bm.free(a)                                             # block 0 cached free, 2 plain free
    b = make_seq("b", ids=[1, 1, 3, 3, 4, 4, 5])           # 1 hit + 3 new > 2 free after the hit
    cached = bm.find_cached_prefix(b)
    assert len(cached) == 1
    assert not bm.try_allocate(b, b.num_tokens, cached)
    assert b.block_table == [] and len(bm.cached_free_block_ids) == 1
    check_accounting(bm, [])


def test_reset_prefix_cache_only_when_idle():
    bm = cached_bm()
    a = make_seq("a", ids=list(range(9)))
    admit(bm, a)
    assert not bm.reset_prefix_cache()
    bm.free(a)
    assert bm.num_cached_blocks == 2
    assert bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0 and len(bm.free_block_ids) == 16
    assert bm.find_cached_prefix(make_seq("b", ids=list(range(9)))) == []
    check_accounting(bm, [])


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_forked_choices_share_the_prompt_and_copy_the_partial_block_before_writing(prefix_caching):
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=prefix_caching)
    parent = make_seq("p", num_prompt_tokens=6)   # one full block, one partial
    admit(bm, parent)
    parent.num_computed_tokens = 6
    children = [make_seq("p", num_prompt_tokens=6) for _ in range(2)]
    for child in children:
        bm.share(parent, child)
        child.num_computed_tokens = 6
    assert all(child.block_table == parent.block_table for child in children)
    check_accounting(bm, [parent, *children])
    full, partial = parent.block_table
    for seq in (children[0], parent):   # each appends one token
        seq.output_token_ids.append(1)
    assert bm.try_allocate(children[0], 7)
    assert children[0].block_table[0] == full and children[0].block_table[1] != partial
    assert bm.take_copies() == [(partial, children[0].block_table[1])] and bm.take_copies() == []
    assert bm.try_allocate(parent, 7)   # still shared with children[1]: copied too
    assert bm.take_copies() == [(partial, parent.block_table[1])]
    children[1].output_token_ids.append(1)
    assert bm.try_allocate(children[1], 7)   # the last holder writes in place
    assert children[1].block_table[1] == partial and bm.take_copies() == []
    check_accounting(bm, [parent, *children])
    for seq in (parent, *children):
        bm.free(seq)
    check_accounting(bm, [])


def test_a_copy_on_write_that_finds_no_free_block_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    parent, child = make_seq("p", num_prompt_tokens=6), make_seq("p", num_prompt_tokens=6)
    admit(bm, parent)
    parent.num_computed_tokens = child.num_computed_tokens = 6
    bm.share(parent, child)
    child.output_token_ids.append(1)
    assert not bm.try_allocate(child, 7)   # the pool is full: the caller preempts
    assert child.block_table == parent.block_table and bm.take_copies() == []
    check_accounting(bm, [parent, child])


def test_table_rows_follow_every_change_to_the_block_tables():
    """Random admissions, decodes, forks (copy on write), truncations and frees, past the
    rows' and widths' first sizes: after each, check_accounting compares every holder's
    array row with its table."""
    rng = random.Random(0)
    bm = BlockManager(num_blocks=400, block_size=4, enable_prefix_caching=True)
    bm.table_rows = BlockTableRows(rows=2, width=3)
    holders: list[Sequence] = []
    for step in range(600):
        op = rng.random()
        if op < 0.25 or not holders:   # admit a prompt, a common prefix half the time
            ids = ([7] * 8 if rng.random() < 0.5 else []) + [rng.randrange(100, 200) for _ in range(rng.randrange(1, 30))]
            seq = make_seq(f"s{step}", ids=ids)
            cached = bm.find_cached_prefix(seq)
            if bm.try_allocate(seq, seq.num_tokens, cached):
                seq.num_computed_tokens = seq.num_tokens
                holders.append(seq)
        elif op < 0.6:   # decode a few tokens
            seq = rng.choice(holders)
            for _ in range(rng.randrange(1, 9)):
                seq.output_token_ids.append(rng.randrange(100, 200))
                if not bm.try_allocate(seq, seq.num_tokens):
                    seq.output_token_ids.pop()
                    break
                seq.num_computed_tokens = seq.num_tokens
        elif op < 0.75:   # fork: the child shares every block, then writes (copy on write)
            parent = rng.choice(holders)
            child = make_seq(parent.request_id, ids=parent.prompt_token_ids)
            child.output_token_ids = list(parent.output_token_ids)
            bm.share(parent, child)
            child.num_computed_tokens = parent.num_computed_tokens
            holders.append(child)
            child.output_token_ids.append(1)
            if bm.try_allocate(child, child.num_tokens):
                child.num_computed_tokens = child.num_tokens
            else:
                child.output_token_ids.pop()
        elif op < 0.85:   # slots for drafts, then the rejected ones' dropped
            seq = rng.choice(holders)
            k = rng.randrange(1, 9)
            if bm.try_allocate(seq, seq.num_tokens + k):
                bm.truncate(seq, seq.num_tokens + rng.randrange(0, k))
        else:   # finished or preempted
            seq = holders.pop(rng.randrange(len(holders)))
            bm.free(seq)
        check_accounting(bm, holders)
    assert bm.table_rows.array.shape[0] > 2 and bm.table_rows.array.shape[1] > 3
