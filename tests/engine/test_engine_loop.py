"""EngineLoop: several callers (threads) share one engine's batches, each getting only its
own results, and each stopping only its own requests. Real tiny model, real threads."""
from __future__ import annotations

import random
import subprocess
import sys
import threading

import pytest

from pipeline import Engine, EngineConfig, Request
from pipeline.engine.engine_loop import EngineLoop
from cluster import TINY_CONTEXT
from engine_helpers import BIG_POOL, all_blocks_free, greedy, random_prompt, run

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # see conftest


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), **BIG_POOL))


@pytest.fixture
def loop(engine):
    loop = EngineLoop(lambda: engine)
    yield loop
    loop.close()
    assert all_blocks_free(engine)


def requests_of(seed: int, n: int, max_tokens=(4, 16)) -> list[Request]:
    """Ids r0..r{n-1}: the same ids in every call, as two jobs' shards may have."""
    rng = random.Random(seed)
    return [Request(f"r{i}", prompt_token_ids=random_prompt(rng, rng.randint(3, 60)),
                    params=greedy(rng.randint(*max_tokens), ignore_eos=True)) for i in range(n)]


def record_steps(engine: Engine, monkeypatch) -> list[set[str]]:
    """The internal request ids of every scheduled step."""
    steps = []
    schedule = engine.scheduler.schedule

    def recording():
        batch = schedule()
        steps.append({s.request_id for s in batch.seqs})
        return batch

    monkeypatch.setattr(engine.scheduler, "schedule", recording)
    return steps


def collect(loop: EngineLoop, requests, results: dict, key: str, **kw) -> None:
    results[key] = {}
    for out in loop.generate(requests, **kw):
        assert out.id not in results[key], f"{out.id} came back twice"
        results[key][out.id] = out


def test_two_callers_share_batches_and_get_only_their_own_results(engine, loop, monkeypatch):
    a, b = requests_of(1, 12, max_tokens=(20, 30)), requests_of(2, 12)
    expected_a, expected_b = run(engine, a), run(engine, b)
    steps = record_steps(engine, monkeypatch)
    results: dict = {}
    a_started = threading.Event()

    def first():
        results["a"] = {}
        for out in loop.generate(a):
            results["a"][out.id] = out
            a_started.set()

    t = threading.Thread(target=first)
    t.start()
    assert a_started.wait(60)
    collect(loop, b, results, "b")            # starts while "a" is still running
    t.join(60)
    assert not t.is_alive()
    for key, expected in (("a", expected_a), ("b", expected_b)):
        assert set(results[key]) == set(expected)
        for rid, out in results[key].items():
            assert out.token_ids == expected[rid].token_ids, (key, rid)
    mixed = [s for s in steps if {i.split(":")[0] for i in s} == {"0", "1"}]
    assert mixed, "the two callers never shared a step"


def test_should_stop_drops_only_that_callers_requests(engine, loop):
    long_a = [Request(f"r{i}", prompt_token_ids=random_prompt(random.Random(i), 20),
                      params=greedy(400, ignore_eos=True)) for i in range(4)]
    b = requests_of(3, 6)
    expected_b = run(engine, b)
    stop = threading.Event()
    results: dict = {}
    t = threading.Thread(target=collect, args=(loop, long_a, results, "a"), kwargs={"should_stop": stop.is_set})
    t.start()
    collect(loop, b, results, "b")
    stop.set()
    t.join(60)
    assert not t.is_alive()
    assert results["a"] == {}                  # stopped before any of its 400-token requests ended
    assert {rid: o.token_ids for rid, o in results["b"].items()} == {rid: o.token_ids for rid, o in expected_b.items()}


def test_a_caller_that_stops_reading_frees_its_requests(engine, loop):
    stream = loop.generate([Request("short", prompt_token_ids=[5, 6, 7], params=greedy(1)),
                            Request("long", prompt_token_ids=[5, 6, 7], params=greedy(300, ignore_eos=True))])
    assert next(stream).id == "short"
    stream.close()
    # The loop thread drops "long" at its next turn; a later caller does not see it.
    outs = {}
    collect(loop, [Request("next", prompt_token_ids=[8, 9], params=greedy(2))], outs, "n")
    assert set(outs["n"]) == {"next"}
    assert loop.num_streams == 0


def test_a_request_that_cannot_run_fails_alone_in_its_own_stream(engine, loop):
    too_long = Request("r0", prompt_token_ids=[5] * (TINY_CONTEXT + 100), params=greedy(2))
    results: dict = {}
    collect(loop, [too_long, *requests_of(4, 2)[1:]], results, "x")
    assert results["x"]["r0"].finish_reason == "error"
    assert "maximum model length" in results["x"]["r0"].error
    assert results["x"]["r1"].finish_reason == "length"


def test_an_engine_failure_reaches_its_callers_and_the_loop_goes_on(engine, loop, monkeypatch):
    real_run = engine.runner.run
    monkeypatch.setattr(engine.runner, "run", lambda *args: (_ for _ in ()).throw(RuntimeError("device lost")))
    with pytest.raises(RuntimeError, match="device lost"):
        list(loop.generate(requests_of(5, 3)))
    monkeypatch.setattr(engine.runner, "run", real_run)
    outs: dict = {}
    collect(loop, requests_of(6, 3), outs, "after")
    assert len(outs["after"]) == 3


def test_closed_loop_refuses_new_callers(engine):
    loop = EngineLoop(lambda: engine)
    loop.close()
    with pytest.raises(RuntimeError, match="closed"):
        next(loop.generate(requests_of(7, 1)))


def test_the_engine_is_built_and_stepped_in_the_loops_own_thread(engine, monkeypatch):
    """One thread does all the engine's torch work (see engine_loop's docstring)."""
    threads = []

    def build():
        threads.append(threading.current_thread())
        return engine

    real_step = engine.step
    monkeypatch.setattr(engine, "step", lambda: threads.append(threading.current_thread()) or real_step())
    loop = EngineLoop(build)
    try:
        assert len(list(loop.generate(requests_of(8, 3)))) == 3
    finally:
        loop.close()
    assert len(threads) > 1 and {t.name for t in threads} == {"engine-loop"} and len(set(threads)) == 1


def test_a_failed_build_is_raised_to_the_caller_and_leaves_no_thread():
    before = threading.active_count()
    with pytest.raises(OSError, match="no such model"):
        EngineLoop(lambda: (_ for _ in ()).throw(OSError("no such model")))
    assert threading.active_count() == before


EXIT_MID_STEP = """
import sys, threading, time
from pipeline import Engine, EngineConfig, Request, SamplingParams
from pipeline.engine.engine_loop import EngineLoop
loop = EngineLoop(lambda: Engine(EngineConfig(device="cpu", model=sys.argv[1])))
requests = [Request(str(i), prompt="hello " * 40, params=SamplingParams(max_tokens=400, ignore_eos=True))
            for i in range(48)]
threading.Thread(target=lambda: list(loop.generate(requests)), daemon=True).start()
while loop.engine.num_steps < int(sys.argv[2]):   # a step count, not a time: 400 steps are far off
    time.sleep(0.001)
assert loop.engine.has_unfinished_requests   # the interpreter exits while the loop steps
"""


def test_the_process_exits_cleanly_while_the_loop_is_stepping(tiny_model_dir):
    # Without the loop closing at exit, its daemon thread is stopped inside a torch op:
    # SIGABRT about half the time (pytorch#38228); three runs.
    for steps in ("1", "8", "32"):
        proc = subprocess.run([sys.executable, "-c", EXIT_MID_STEP, str(tiny_model_dir), steps],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
