"""EngineCache: one engine loop per process, shared by the shards in flight, rebuilt only
for other options once nobody uses it, and never handed out once it stopped serving; and
the AdmissionGate in front of it."""
from __future__ import annotations

import threading

import pytest

from pipeline import Request, SamplingParams
from polling import wait_until
from workers.admission import AdmissionGate
from workers.engine_cache import EngineCache

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # see conftest


@pytest.fixture
def options(tiny_model_dir):
    return {"model": str(tiny_model_dir), "num_kv_blocks": 64, "device": "cpu"}


def generate_one(loop) -> int:
    (out,) = loop.generate([Request("x", prompt_token_ids=[5, 6, 7], params=SamplingParams(max_tokens=2))])
    return out.output_tokens


def test_same_options_share_one_loop(options):
    holder = EngineCache()
    with holder.use(options) as a, holder.use(dict(options)) as b:
        assert a is b and a.is_serving
        assert generate_one(a) == 2
    holder.close()
    assert not a.is_serving


def test_other_options_wait_until_the_engine_is_free(options):
    holder = EngineCache()
    other = {**options, "num_kv_blocks": 32}
    got, entered, done = {}, threading.Event(), threading.Event()

    def shard_with_other_options():
        with holder.use(other) as loop:
            got["loop"] = loop
            entered.set()
            done.wait(60)

    with holder.use(options) as first:
        t = threading.Thread(target=shard_with_other_options)
        t.start()
        # It looked at the engine, found it in use and waits for it (a state, not a time):
        wait_until("the other options' shard to wait for the engine", lambda: holder.num_waiting == 1,
                   timeout=60, poll_s=0.01)
        assert not entered.is_set() and first.is_serving   # not rebuilt under a running shard
    assert entered.wait(60)
    assert got["loop"] is not first and not first.is_serving
    assert got["loop"].engine.block_manager.num_blocks == 32
    done.set()
    t.join(60)
    holder.close()


def test_a_loop_that_stopped_serving_is_replaced(options):
    holder = EngineCache()
    with holder.use(options) as broken:
        pass
    broken.close()                                          # as if its thread had died
    with holder.use(options) as fresh:
        assert fresh is not broken and generate_one(fresh) == 2
    holder.close()


def test_a_shard_starts_only_when_the_batch_has_room(options):
    """max_num_seqs 2: the loop keeps 4 requests at hand; while a shard keeps it at 4,
    the next shard waits; it goes once fewer are left, or at once when told to stop."""
    holder = EngineCache()
    gate = AdmissionGate(holder)
    finished = []
    with holder.use({**options, "max_num_seqs": 2}) as loop:
        requests = [Request(f"a{i}", prompt_token_ids=[5 + i, 6, 7], params=SamplingParams(
            max_tokens=40 + 10 * i, ignore_eos=True)) for i in range(6)]
        first = threading.Thread(target=lambda: finished.extend(o.id for o in loop.generate(requests)))
        first.start()
        wait_until("the first shard to fill the batch", lambda: loop.num_unfinished >= 4, timeout=30, poll_s=0.01)
        assert not loop.has_room
        waits = []
        with gate.room(stop=lambda: True):                # told to stop: enters at once
            pass
        with gate.room(stop=lambda: False, while_waiting=lambda: waits.append(1)):
            wait_until("3 of the first shard's requests to finish", lambda: len(finished) >= 3, timeout=30,
                       poll_s=0.01)   # entered once the first shard drained (its thread may lag the engine a little)
        assert waits                                        # and was told it waited
        first.join(60)
    holder.close()


def test_waiting_shards_enter_by_rank_then_job_then_index():
    """Threads reach the gate in any order: a higher rank goes first, then the job that
    came first, and one job's shards in index order."""
    gate = AdmissionGate(EngineCache())
    entered, release = [], threading.Event()

    def enter(shard, rank=1):
        with gate.room(stop=lambda: False, rank=rank, shard=shard, settle_s=60):
            entered.append(shard)
            if shard == ("a", 0):
                release.wait(30)   # the next may enter only once this one left

    threads = [threading.Thread(target=enter, args=(("a", 0),))]
    threads[0].start()
    wait_until("a0 to enter", lambda: entered == [("a", 0)], timeout=30, poll_s=0.01)
    for shard, rank in ((("b", 2), 1), (("a", 3), 1), (("b", 1), 1), (("a", 2), 1), (("c", 5), 0), (("a", 1), 1)):
        waiting = gate.num_waiting
        threads.append(threading.Thread(target=enter, args=(shard, rank)))
        threads[-1].start()
        wait_until(f"{shard} at the gate", lambda: gate.num_waiting == waiting + 1, timeout=30,
                   poll_s=0.01)   # arrived, in this order
    release.set()
    for thread in threads:
        thread.join(30)
    assert entered == [("a", 0), ("c", 5), ("b", 1), ("b", 2), ("a", 1), ("a", 2), ("a", 3)]
    assert gate.num_waiting == 0

