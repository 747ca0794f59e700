"""The admission gate: a shard starts only when the engine's batch has room for it.

Small shards then run many at a time until the batch is full, large ones about two at a
time, and no shard is claimed only to wait. Waiting shards are ordered by Ticket: rank
(0 first: a higher-priority job's, jobs.scheduling), then their job's arrival, then the
shard's index, then their own arrival. A worker reserves several messages at once, so a
high-priority shard that arrives behind reserved low ones still goes before them; and
threads reach the gate in no particular order, so one job's shards are put back in index
order, and the engine's batches follow the input file as `pipeline bench`'s do.
"""
from __future__ import annotations

import bisect
import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from workers.engine_cache import EngineCache


@dataclass(frozen=True, order=True)
class Ticket:
    """A waiting shard's place in line (compared field by field, in this order)."""
    rank: int
    job_arrival: int   # the arrival of the first of its job's shards still waiting
    index: int
    arrival: int       # unique: two tickets are never equal, and job ids never compared
    job: str | None = field(compare=False)


class AdmissionGate:
    """Lets the shards of one process into its engine's batch one at a time, in Ticket order.

    One lock (a condition) guards the line; a waiting shard waits on it, woken when the
    line changes and looking again every poll_s (the batch's room changes unannounced)."""

    def __init__(self, engines: EngineCache):
        self._engines = engines
        self._changed = threading.Condition()
        self._waiting: list[Ticket] = []   # sorted: only the first may enter
        self._arrivals = itertools.count()
        self._settling: Callable[[], bool] | None = None   # true until the last shard let in has started

    @property
    def num_waiting(self) -> int:
        with self._changed:
            return len(self._waiting)

    @contextlib.contextmanager
    def room(self, stop: Callable[[], bool], while_waiting: Callable[[], None] | None = None,
             poll_s: float = 0.05, settle_s: float = 2.0, rank: int = 0,
             shard: tuple[str, int] | None = None) -> Iterator[None]:
        """Enter once the engine's batch has room for another shard's requests (or there
        is no engine yet, or stop() is true); hold it while the shard runs.

        Shards enter one at a time, each after the one before it has put its requests in
        (or has left: a duplicate that found its shard busy runs nothing), or settle_s
        passed, so a batch with room for a few requests does not let in every waiting
        shard. while_waiting() is called every poll while this shard waits (the task keeps
        its shard's place in the ledger with it). shard: (job id, index), for the order."""
        left = threading.Event()
        ticket = self._line_up(rank, shard)
        try:
            while True:
                with self._changed:
                    if self._waiting[0] == ticket and (stop() or self._may_enter()):
                        self._settling = self._settling_after(left, settle_s)
                        break
                if while_waiting is not None:
                    while_waiting()
                with self._changed:
                    self._changed.wait(timeout=poll_s)
        finally:
            with self._changed:
                self._waiting.remove(ticket)
                self._changed.notify_all()
        try:
            yield
        finally:
            left.set()
            with self._changed:
                self._changed.notify_all()

    def _line_up(self, rank: int, shard: tuple[str, int] | None) -> Ticket:
        """This shard's ticket. Its job's arrival is that of the job's shards already
        waiting, if any (once none waits, a later shard of the job lines up as a new arrival)."""
        job, index = shard if shard is not None else (None, 0)
        with self._changed:
            arrival = next(self._arrivals)
            job_arrival = next((t.job_arrival for t in self._waiting if job is not None and t.job == job), arrival)
            ticket = Ticket(rank, job_arrival, index, arrival, job)
            bisect.insort(self._waiting, ticket)
        return ticket

    def _may_enter(self) -> bool:
        """Whether the last shard let in has settled and the batch has room."""
        if self._settling is not None and self._settling():
            return False
        loop = self._engines.loop
        return loop is None or not loop.is_serving or loop.has_room

    def _settling_after(self, left: threading.Event, settle_s: float) -> Callable[[], bool]:
        """True until the shard entering now has put its requests in, left, or settle_s passed.
        Its requests are in once the loop has been fed by one more stream: the count of its
        unfinished requests could not tell, since on short requests the engine finishes the
        shards before it faster than the new one puts its first in."""
        engines, loop = self._engines, self._engines.loop
        deadline = time.monotonic() + settle_s
        if loop is None:   # the first shard builds the engine: the next waits for that
            return lambda: not left.is_set() and (
                engines.building or (engines.loop is None and time.monotonic() < deadline))
        before = loop.num_streams_fed
        return lambda: not left.is_set() and loop.num_streams_fed <= before and time.monotonic() < deadline
