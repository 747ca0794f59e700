"""Holding a job mid-generation until the test has done what it races against the job (a
signal, a cancel, a kill, a broker restart), on any machine, fast or slow.

The real CLI, worker and engine, except that the engine stops stepping once a request
whose id starts with "held-" has generated AFTER_TOKENS tokens (an embedding request:
computed that many of its input's), every running sequence being of its group (the id
without its last "-" part: "held-a1-003" is of "held-a1"; a request of another group, say
a quick first shard, finishes first). Its whole batch waits there, so nothing it holds
can finish before the test acts, however fast the CPU. The
hold ends when that request's stream stops (its shard saw the cancel, the job's expiry,
a lost lease or the worker's shutdown: the stop the test was racing for), or when the test
releases the group (a file of the group's name in TEST_HOLD_DIR). A request of the prefix
with a timeout_s cannot time out before its group is held (its timeout waits for the hold,
however slow the machine); if every running request of the group has one, the hold then
moves their clocks past it (move_past_timeout: the next step retires them, with no time to
wait out, however fast). Each group is held at most once per process. While held, the
process says so on stderr:

    held: held-003 after 4 tokens (group held)

and the test waits for that line (a state), not for a time. A stream whose first request's
id starts with "parked-" instead enters nothing into the engine until it stops or its group
is released (its shard is claimed, and the engine serves the others meanwhile). Nothing
here is in the product code: like tests/crashing_worker.py, it wraps the real classes from
outside.

    python -m tests.hold cli run FILE ...     # any module run as `python -m`
    python -m tests.hold celery -A workers.app worker ...
    with installed(prefix="long"): ...                 # in-process (restored on exit)
"""
from __future__ import annotations

import contextlib
import itertools
import os
import runpy
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

AFTER_TOKENS = 4
PREFIX = "held-"
PARKED = "parked-"


def group_of(request_id: str) -> str:
    return request_id.rsplit("-", 1)[0]


class Hold:
    def __init__(self, prefix: str = PREFIX, release_dir: Path | None = None,
                 group: Callable[[str], str] = group_of):
        self.prefix, self.release_dir, self.group_of = prefix, release_dir, group
        self.held_groups: set[str] = set()    # held once already in this process
        self.stopped: set[str] = set()        # request ids whose stream stopped early
        self.changed = threading.Condition()

    def after_step(self, engine) -> None:
        """In the engine's thread, after each step: hold here if a held request is due."""
        # an EngineLoop's ids are "<stream>:<request id>"
        running = [(seq.request_id.split(":", 1)[-1], seq) for seq in engine.scheduler.running]
        for request_id, seq in running:   # (the engine checks timeouts at the start of a step)
            if (request_id.startswith(self.prefix) and seq.timeout_s is not None
                    and self.group_of(request_id) not in self.held_groups):
                seq.is_timed_out = _not_before_the_hold   # this sequence's own, until _hold
        for request_id, seq in running:
            group = self.group_of(request_id)
            done = seq.num_output_tokens if seq.pooling is None else seq.num_computed_tokens
            if (request_id.startswith(self.prefix) and group not in self.held_groups and done >= AFTER_TOKENS
                    and all(self.group_of(other) == group for other, _ in running)):
                self.held_groups.add(group)
                self._hold(request_id, group, [s for _, s in running])
                return

    def _hold(self, request_id: str, group: str, seqs: list) -> None:
        shown = request_id.replace("\0", "/")   # (an embedding input's id: the line's, NUL, its index)
        print(f"held: {shown} after {AFTER_TOKENS} tokens (group {group})", file=sys.stderr, flush=True)
        for seq in seqs:
            vars(seq).pop("is_timed_out", None)   # the class's again: its clock counts from here
        if all(seq.timeout_s is not None for seq in seqs):
            for seq in seqs:
                move_past_timeout(seq)
        with self.changed:
            while (request_id not in self.stopped and not self.released(group)
                   and not all(seq.is_timed_out(time.perf_counter()) for seq in seqs)):
                self.changed.wait(timeout=0.01)   # (a release file is not announced)
        print(f"released: {shown}", file=sys.stderr, flush=True)

    def released(self, group: str) -> bool:
        return self.release_dir is not None and (self.release_dir / group).exists()

    def stream_stopped(self, request_ids: list[str]) -> None:
        with self.changed:
            self.stopped.update(request_ids)
            self.changed.notify_all()


def _not_before_the_hold(now: float) -> bool:
    return False


def move_past_timeout(seq) -> None:
    """Date a running sequence's clock back by its timeout_s, as if that long had passed since
    its first step: the engine's next step retires it (timed out), its latency counts the
    time, and nothing waits for a clock, on any machine. Only its own timestamps move (its
    queue time and time to first token stay what they were)."""
    shift = seq.timeout_s
    seq.arrival_time -= shift
    seq.first_scheduled_time -= shift
    if seq.first_token_time is not None:
        seq.first_token_time -= shift


def release(release_dir: Path, group: str) -> None:
    """End the hold of `group` in every process of this TEST_HOLD_DIR (and any later one)."""
    release_dir.mkdir(parents=True, exist_ok=True)
    (release_dir / group).touch()


@contextlib.contextmanager
def installed(prefix: str = PREFIX, release_dir: Path | None = None, group: Callable[[str], str] = group_of):
    """Wrap Engine.step and EngineLoop.generate (the classes, so every engine of the process)."""
    from pipeline.engine.engine import Engine
    from pipeline.engine.engine_loop import EngineLoop

    hold = Hold(prefix, release_dir, group)
    real_step, real_generate = Engine.step, EngineLoop.generate

    def step(engine):
        finished = real_step(engine)
        hold.after_step(engine)
        return finished

    def generate(loop, requests, should_stop=None):
        ids: list[str] = []
        requests = iter(requests)
        first = next(requests, None)

        def pulled():
            for request in itertools.chain([first] if first is not None else [], requests):
                ids.append(request.id)
                yield request

        def stop() -> bool:
            if should_stop is not None and should_stop():
                hold.stream_stopped(ids)
                return True
            return False

        if first is not None and first.id.startswith(PARKED):
            print(f"parked: {first.id} (group {group(first.id)})", file=sys.stderr, flush=True)
            while not hold.released(group(first.id)):
                if stop():
                    return
                time.sleep(0.05)
        yield from real_generate(loop, pulled(), stop)

    Engine.step, EngineLoop.generate = step, generate
    try:
        yield hold
    finally:
        Engine.step, EngineLoop.generate = real_step, real_generate


if __name__ == "__main__":
    module, sys.argv = sys.argv[1], sys.argv[1:]
    release_dir = Path(os.environ["TEST_HOLD_DIR"]) if os.environ.get("TEST_HOLD_DIR") else None
    with installed(os.environ.get("TEST_HOLD_PREFIX", PREFIX), release_dir):
        runpy.run_module(module, run_name="__main__", alter_sys=True)
