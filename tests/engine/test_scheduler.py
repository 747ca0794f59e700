"""Scheduler: continuous batching, chunked prefill, preemption. Torch-free.

`advance` plays the engine's part after a step: the scheduled tokens are now in the
cache, and a sequence whose tokens are all computed samples one more token.
"""
from __future__ import annotations

import random

import pytest

from pipeline.engine.block_manager import BlockManager
from pipeline.engine.detokenizer import IncrementalDetokenizer
from pipeline.sampling_params import SamplingParams
from pipeline.engine.scheduler import Scheduler
from pipeline.engine.sequence import Sequence, SequenceStatus


def make_seq(request_id: str, num_prompt_tokens: int, max_tokens: int = 4,
             ids: list[int] | None = None) -> Sequence:
    ids = [100 + i for i in range(num_prompt_tokens)] if ids is None else ids
    return Sequence(request_id, ids, SamplingParams(max_tokens=max_tokens),
                    IncrementalDetokenizer(None, ids, []))


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                   max_model_len=10_000, prefix_caching=False, admission_group=1) -> Scheduler:
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    return Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                     max_model_len=max_model_len, admission_group=admission_group)


def advance(sched: Scheduler, batch) -> list[Sequence]:
    """Apply a step's results; returns the sequences that finished."""
    finished = []
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.output_token_ids.append(7)
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq)
                finished.append(seq)
    return finished


def scheduled(batch) -> dict[str, int]:
    return {s.request_id: n for s, n in zip(batch.seqs, batch.num_new_tokens)}


def check_invariants(sched: Scheduler) -> None:
    bm = sched.block_manager
    refs: dict[int, int] = {}
    for s in sched.running:
        for b in s.block_table:
            refs[b] = refs.get(b, 0) + 1
    if not bm.enable_prefix_caching:
        assert all(n == 1 for n in refs.values()), "a block belongs to two sequences"
    assert all(bm.blocks[b].ref_count == n for b, n in refs.items())
    assert set(refs).isdisjoint(bm.free_block_ids) and set(refs).isdisjoint(bm.cached_free_block_ids)
    assert len(refs) + bm.num_free_blocks == bm.num_blocks, "blocks leaked"
    for s in sched.waiting:
        assert s.block_table == [] and s.num_computed_tokens == 0
        assert s.status == SequenceStatus.WAITING
    for s in sched.running:
        assert s.status == SequenceStatus.RUNNING
        assert len(s.block_table) * bm.block_size >= s.num_computed_tokens


def test_admits_while_budget_and_sequence_limit_allow():
    sched = make_scheduler(max_num_seqs=3, max_num_batched_tokens=100)
    seqs = [make_seq(f"s{i}", 5) for i in range(5)]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert scheduled(batch) == {"s0": 5, "s1": 5, "s2": 5}      # whole prompts, up to max_num_seqs
    assert [s.request_id for s in sched.running] == ["s0", "s1", "s2"]
    assert [s.request_id for s in sched.waiting] == ["s3", "s4"]
    assert all(s.status == SequenceStatus.RUNNING for s in seqs[:3])
    advance(sched, batch)
    sched.finish(seqs[1])
    # Continuous batching: a new sequence joins beside the decodes as soon as a slot frees up.
    batch = sched.schedule()
    assert scheduled(batch) == {"s0": 1, "s2": 1, "s3": 5}
    assert batch.num_tokens == 7


def test_admission_in_groups_waits_for_that_many_free_slots():
    sched = make_scheduler(max_num_seqs=4, admission_group=2)
    seqs = [make_seq(f"s{i}", 4, max_tokens=m) for i, m in enumerate([2, 3, 6, 7, 4, 4, 3])]
    for s in seqs:
        sched.add(s)
    steps = []
    while sched.num_unfinished:
        batch = sched.schedule()
        steps.append(scheduled(batch))
        advance(sched, batch)
        check_invariants(sched)
    assert steps[:6] == [
        {"s0": 4, "s1": 4, "s2": 4, "s3": 4},   # nothing runs: admitted at once
        {"s0": 1, "s1": 1, "s2": 1, "s3": 1},   # s0 finishes
        {"s1": 1, "s2": 1, "s3": 1},            # one slot free: no prefill beside the decodes
        {"s2": 1, "s3": 1, "s4": 4, "s5": 4},   # s1 finished: two free, two admitted together
        {"s2": 1, "s3": 1, "s4": 1, "s5": 1},
        {"s2": 1, "s3": 1, "s4": 1, "s5": 1},   # s2 finishes
    ]
    assert steps[6] == {"s3": 1, "s4": 1, "s5": 1, "s6": 4}   # one waits, one slot free: all that wait fit
    assert all(s.num_output_tokens == s.params.max_tokens for s in seqs)


def test_token_budget_splits_the_next_prompt():
    sched = make_scheduler(max_num_batched_tokens=10)
    for i in range(4):
        sched.add(make_seq(f"s{i}", 4))
    batch = sched.schedule()
    # Two whole prompts, then the third gets the 2 tokens left; the fourth waits.
    assert scheduled(batch) == {"s0": 4, "s1": 4, "s2": 2}
    assert batch.num_tokens == 10
    assert [s.request_id for s in sched.waiting] == ["s3"]
    advance(sched, batch)
    assert [s.num_output_tokens for s in sched.running] == [1, 1, 0]   # s2 is still prefilling
    batch = sched.schedule()
    assert scheduled(batch) == {"s0": 1, "s1": 1, "s2": 2, "s3": 4}


def test_chunked_prefill_runs_beside_decodes():
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=16)
    short = make_seq("short", 3, max_tokens=100)
    sched.add(short)
    advance(sched, sched.schedule())               # short is decoding now
    long = make_seq("long", 50, max_tokens=2)
    sched.add(long)
    chunks = []
    while long.num_output_tokens == 0:
        batch = sched.schedule()
        assert batch.num_tokens <= 16
        got = scheduled(batch)
        assert got["short"] == 1                   # the decode is never starved by the prefill
        chunks.append(got["long"])
        advance(sched, batch)
        check_invariants(sched)
    assert chunks == [15, 15, 15, 5]
    assert sum(chunks) == 50
    assert long.num_computed_tokens == 50 and long.num_tokens == 51
    assert scheduled(sched.schedule()) == {"short": 1, "long": 1}


def test_preempts_newest_running_sequence_and_recomputes_it():
    # 3 blocks of 4 tokens: "old" holds 2 blocks, "new" holds 1; when "old" needs a third
    # block, "new" (the newest) is preempted.
    sched = make_scheduler(num_blocks=3, block_size=4, max_num_batched_tokens=64)
    old, new = make_seq("old", 8, max_tokens=3), make_seq("new", 3, max_tokens=3)
    sched.add(old)
    sched.add(new)
    batch = sched.schedule()
    assert scheduled(batch) == {"old": 8, "new": 3}
    advance(sched, batch)
    assert sched.block_manager.num_free_blocks == 0

    batch = sched.schedule()
    assert scheduled(batch) == {"old": 1}
    assert sched.num_preemptions == 1 and new.num_preemptions == 1 and old.num_preemptions == 0
    assert new.status == SequenceStatus.WAITING
    assert new.num_computed_tokens == 0           # recompute from scratch
    assert new.block_table == []
    assert new.output_token_ids == [7]            # its output so far is kept
    assert list(sched.waiting) == [new]
    assert len(old.block_table) == 3
    check_invariants(sched)

    # Once "old" is done, "new" is recomputed over its prompt and its output so far.
    while not old.is_finished:
        advance(sched, batch)
        if old.is_finished:
            break
        batch = sched.schedule()
    batch = sched.schedule()
    assert scheduled(batch) == {"new": 4}
    advance(sched, batch)
    assert new.num_output_tokens == 2
    check_invariants(sched)


def test_preemption_takes_the_newest_first():
    # 4 blocks: a (2 blocks), b and c (1 each). When "a" grows, "c" goes, not "b".
    sched = make_scheduler(num_blocks=4, block_size=4)
    a, b, c = make_seq("a", 8, max_tokens=9), make_seq("b", 2, max_tokens=9), make_seq("c", 2, max_tokens=9)
    for s in (a, b, c):
        sched.add(s)
    advance(sched, sched.schedule())
    batch = sched.schedule()
    assert scheduled(batch) == {"a": 1, "b": 1}
    assert (a.num_preemptions, b.num_preemptions, c.num_preemptions) == (0, 0, 1)
    assert sched.running == [a, b] and list(sched.waiting) == [c]
    check_invariants(sched)


def test_no_admission_in_a_step_that_preempted():
    sched = make_scheduler(num_blocks=3, block_size=4)
    old, new = make_seq("old", 8, max_tokens=5), make_seq("new", 3, max_tokens=5)
    sched.add(old)
    sched.add(new)
    advance(sched, sched.schedule())
    tiny = make_seq("tiny", 1)
    sched.add(tiny)
    batch = sched.schedule()                       # preempts "new"; must not admit "tiny" either
    assert scheduled(batch) == {"old": 1}
    assert [s.request_id for s in sched.waiting] == ["new", "tiny"]


def test_a_sequence_preempts_itself_when_it_is_the_newest():
    sched = make_scheduler(num_blocks=3, block_size=4)
    old, new = make_seq("old", 3, max_tokens=9), make_seq("new", 8, max_tokens=9)
    sched.add(old)
    sched.add(new)
    advance(sched, sched.schedule())               # old: 4 tokens in 1 block; new: 9 tokens, 2 blocks
    batch = sched.schedule()                       # new needs a third block: nobody newer to evict
    assert scheduled(batch) == {"old": 1}
    assert new.num_preemptions == 1 and old.num_preemptions == 0
    assert list(sched.waiting) == [new] and sched.running == [old]
    check_invariants(sched)


def test_admission_error_for_prompts_that_can_never_fit():
    sched = make_scheduler(num_blocks=8, block_size=4, max_model_len=20)
    assert sched.max_model_len == 20
    assert "empty" in sched.admission_error(make_seq("e", 0))
    err = sched.admission_error(make_seq("long", 20))
    assert err is not None and "20 tokens" in err and "maximum model length" in err
    assert sched.admission_error(make_seq("ok", 19)) is None
    # The whole cache (8 blocks of 4 = 32 tokens) must hold the prompt plus max_tokens: a
    # request the cache would cut before its max_tokens is refused, not cut with `length`.
    small = make_scheduler(num_blocks=8, block_size=4, max_model_len=1000)
    assert small.max_model_len == 32
    err = small.admission_error(make_seq("big", 40))
    assert "may need 44 tokens of KV cache" in err and "the whole cache holds 32" in err
    err = small.admission_error(make_seq("grows past it", 29, max_tokens=4))
    assert "29 prompt tokens plus max_tokens 4" in err and "kv_cache_gib" in err
    assert small.admission_error(make_seq("fits", 28, max_tokens=4)) is None
    # Past the context the model cuts it (`length`): only what it may reach counts.
    cramped = make_scheduler(num_blocks=8, block_size=4, max_model_len=30)
    assert cramped.admission_error(make_seq("cut by the context", 10, max_tokens=100)) is None
    err = make_scheduler(num_blocks=8, block_size=4, max_model_len=40).admission_error(
        make_seq("over", 10, max_tokens=100))
    assert "may need 40 tokens" in err and "up to the maximum model length of 40" in err
    # Choices of an n > 1 request share the prompt's blocks but may each grow alone: the same bound.
    forked = Sequence("n3", [100] * 20, SamplingParams(max_tokens=12, n=3),
                      IncrementalDetokenizer(None, [100] * 20, []))
    assert small.admission_error(forked) is None
    forked.params = SamplingParams(max_tokens=13, n=3)
    assert small.admission_error(forked) is not None


def test_finish_and_abort_all_free_every_block():
    sched = make_scheduler(num_blocks=10, block_size=4, max_num_seqs=2, max_num_batched_tokens=12)
    seqs = [make_seq(f"s{i}", 6, max_tokens=50) for i in range(4)]
    for s in seqs:
        sched.add(s)
    advance(sched, sched.schedule())
    assert len(sched.running) == 2 and len(sched.waiting) == 2
    assert sched.block_manager.num_free_blocks < 10
    sched.finish(seqs[0])
    assert seqs[0].is_finished and seqs[0].block_table == []
    assert sched.num_unfinished == 3
    dropped = sched.abort_all()
    assert {s.request_id for s in dropped} == {"s1", "s2", "s3"}
    assert all(s.is_finished and s.block_table == [] for s in dropped)
    assert sched.num_unfinished == 0
    assert sched.block_manager.num_free_blocks == 10


@pytest.mark.parametrize("admission_group", [1, 3], ids=["admit-each", "admit-in-threes"])
@pytest.mark.parametrize("prefix_caching", [False, True], ids=["plain", "prefix-caching"])
@pytest.mark.parametrize("seed", range(6))
def test_random_workload_completes_within_limits(seed, prefix_caching, admission_group):
    """Many sequences through a small pool: every step respects the token budget and
    the sequence limit, blocks are never leaked (nor shared, without prefix caching), and
    everything finishes (the pool is small enough that sequences get preempted, and with
    prefix caching that cached blocks get evicted)."""
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=12, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                           prefix_caching=prefix_caching, admission_group=admission_group)
    prefixes = [[rng.randint(0, 50) for _ in range(rng.randint(0, 14))] for _ in range(3)]
    seqs = []
    for i in range(20):
        prompt = rng.choice(prefixes) + [rng.randint(0, 50) for _ in range(rng.randint(1, 16))]
        seqs.append(make_seq(f"s{i}", 0, max_tokens=rng.randint(1, 12), ids=prompt))
    for s in seqs:
        assert sched.admission_error(s) is None
        sched.add(s)
    finished, steps = [], 0
    while sched.num_unfinished:
        batch = sched.schedule()
        assert batch.seqs, "empty step with work pending"
        assert 0 < batch.num_tokens <= 16
        assert len(sched.running) <= 4
        assert len({id(s) for s in batch.seqs}) == len(batch.seqs)
        for s, n in zip(batch.seqs, batch.num_new_tokens):
            assert 1 <= n <= s.num_uncomputed_tokens
            assert len(s.block_table) * 4 >= s.num_computed_tokens + n
        finished += advance(sched, batch)
        check_invariants(sched)
        steps += 1
        assert steps < 2000
    assert sorted(s.request_id for s in finished) == sorted(s.request_id for s in seqs)
    assert all(s.num_output_tokens == s.params.max_tokens for s in seqs)
    assert sched.block_manager.num_free_blocks == 12
    assert sched.num_preemptions > 0
    if not prefix_caching:
        assert all(s.num_cached_tokens == 0 for s in seqs)


# ---- prefix caching -----------------------------------------------------------------------

def test_a_cached_prefix_is_not_computed_again_and_costs_no_budget():
    sched = make_scheduler(block_size=4, max_num_batched_tokens=8, prefix_caching=True)
    first = make_seq("first", 0, max_tokens=1, ids=list(range(12)))
    sched.add(first)
    advance(sched, sched.schedule())
    first_blocks = list(first.block_table)
    advance(sched, sched.schedule())
    assert first.is_finished
    second = make_seq("second", 0, max_tokens=1, ids=list(range(8)) + [90, 91, 92, 93, 94])
    sched.add(second)
    batch = sched.schedule()
    assert scheduled(batch) == {"second": 5}          # 8 cached tokens skipped, 5 within the budget of 8
    assert second.num_cached_tokens == 8
    assert second.block_table[:2] == first_blocks[:2]
    check_invariants(sched)


def test_requests_arriving_together_compute_a_shared_prefix_once():
    sched = make_scheduler(block_size=4, max_num_seqs=8, max_num_batched_tokens=64, prefix_caching=True)
    prefix = list(range(16))
    seqs = [make_seq(f"s{i}", 0, ids=prefix + [200 + i, 300 + i]) for i in range(5)]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    # The first computes the prefix; the others, admitted in the same step, share its blocks.
    assert scheduled(batch) == {"s0": 18, "s1": 2, "s2": 2, "s3": 2, "s4": 2}
    assert [s.num_cached_tokens for s in seqs] == [0, 16, 16, 16, 16]
    assert all(s.block_table[:4] == seqs[0].block_table[:4] for s in seqs)
    check_invariants(sched)


def test_a_preempted_sequence_hits_its_own_blocks_again():
    sched = make_scheduler(num_blocks=4, block_size=4, prefix_caching=True)
    old, new = make_seq("old", 4, max_tokens=3), make_seq("new", 0, max_tokens=9, ids=[1] * 8)
    sched.add(old)
    sched.add(new)
    advance(sched, sched.schedule())                  # old: 1 block, new: 2 full blocks
    new_blocks = list(new.block_table)
    batch = sched.schedule()                          # both need a block, one is free
    assert scheduled(batch) == {"old": 1} and new.num_preemptions == 1
    assert sorted(sched.block_manager.cached_free_block_ids) == sorted(new_blocks)   # kept findable
    advance(sched, batch)
    advance(sched, sched.schedule())                  # old finishes
    assert old.is_finished
    batch = sched.schedule()
    assert scheduled(batch) == {"new": 1}             # 8 of its 9 tokens come from the cache
    assert new.block_table[:2] == new_blocks and new.num_computed_tokens == 8
    assert new.num_cached_tokens == 0                 # counted at first admission only
    check_invariants(sched)
