"""The engines a process serves, one loaded at a time and shared by every shard running in it.

The engine is wrapped in an EngineLoop, so the shards in flight in this process (the
worker's threads, or `pipeline run`'s) feed one continuous batch: while one shard's last
requests drain, the next shard's already run beside them. A shard starts only when the
batch has room for it (room): small shards then run many at a time until the
batch is full, large ones about two at a time, and no shard is claimed only to wait.
"""
from __future__ import annotations

import bisect
import contextlib
import dataclasses
import gc
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator

from pipeline.config import EngineConfig
from pipeline.engine_key import engine_key
from workers import metrics
from workers.metrics import EngineObserver

log = logging.getLogger(__name__)


class UnservedEngine(RuntimeError):
    """A shard for an engine this worker was not started for (routing sends none)."""


class EngineHolder:
    """Hands out the process's engine loop for a job's engine options (EngineConfig fields).

    served: the engine options a worker was started with (`pipeline worker --model DIR
    ...`), one dict per engine key it serves (pipeline.engine_key). A shard then gets the
    served engine of its job's key, built with the worker's own options (a job's device
    or KV budget never resize a worker's engine); without served (`pipeline run`), a job
    gets an engine built from its own options.

    Building is lazy (never at import or fork: CUDA must not be initialised in a prefork
    parent; `preload` builds the first served engine on purpose, after the fork) and
    happens again only when a shard needs another engine: that shard waits until no
    shard uses the loaded one, and shards for the loaded engine go first meanwhile. While
    has_work(key) says the loaded engine's queue still holds shards, the switch waits
    for them too, for at most switch_after_s after the loaded engine fell idle (its
    shards may not reach this process while the waiting ones fill its task slots).
    """

    def __init__(self, served: list[dict] | tuple = (), has_work: Callable[[str], bool] | None = None,
                 switch_after_s: float = 10.0):
        self._served_options = list(served)
        self._served = {engine_key(options): EngineConfig(**options) for options in served}
        self._has_work, self._switch_after_s = has_work, switch_after_s
        self._changed = threading.Condition()
        self._config: EngineConfig | None = None
        self._key: str | None = None   # the loaded engine's key
        self._loop = None
        self._users = 0
        self._idle_since = time.monotonic()
        # room's waiting shards as sorted (rank, job's arrival, shard index, arrival, job id)
        # tickets: only the first may enter.
        self._waiting: list[tuple] = []
        self._waiting_lock = threading.Lock()
        self._arrivals = itertools.count()
        self._settling: Callable[[], bool] | None = None   # true until the last shard let in has started
        self._building = False

    @property
    def served_keys(self) -> list[str]:
        return list(self._served)

    def config_for(self, options: dict) -> EngineConfig:
        """The engine a job with these options runs on here; UnservedEngine if none."""
        if not self._served:
            return EngineConfig(**options)
        key = engine_key(options)
        if key not in self._served:
            raise UnservedEngine(f"this worker serves engine(s) {', '.join(self._served)}, not {key}")
        return self._served[key]

    def preload(self) -> None:
        """Build the first served engine now (a worker at start-up), not on its first shard."""
        if self._served:
            with self.use(self._served_options[0]):
                pass

    @contextlib.contextmanager
    def use(self, options: dict) -> Iterator:
        """The engine loop for `options` (building or rebuilding it if needed), held until exit."""
        config = self.config_for(options)
        with self._changed:
            while True:
                if self._loop is not None and self._loop.is_serving and config == self._config:
                    break   # the loaded engine: it goes first
                if self._users == 0 and not self._keep_loaded():
                    self._build(config)
                    break
                self._changed.wait(timeout=1.0)   # has_work and the idle time change unannounced
            self._users += 1
            loop = self._loop
        try:
            yield loop
        finally:
            with self._changed:
                self._users -= 1
                if self._users == 0:
                    self._idle_since = time.monotonic()
                self._changed.notify_all()

    def _keep_loaded(self) -> bool:
        """Whether a switch away from the loaded (unused) engine should wait for its queue."""
        if self._loop is None or not self._loop.is_serving or self._has_work is None:
            return False
        if time.monotonic() - self._idle_since >= self._switch_after_s:
            return False
        try:
            return self._has_work(self._key)
        except Exception:   # the broker is away: do not hold the other shards for it
            log.warning("asking whether engine %s has work queued failed", self._config, exc_info=True)
            return False

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
        its shard's place in the ledger with it).

        Only the first of the waiting shards may enter. They are ordered by rank (0 first:
        a higher-priority job's, jobs.scheduling), then in the order they came: a worker
        reserves several messages at once, and a high-priority shard that arrives behind
        reserved low ones goes before them. The waiting shards of one job (shard: (job id,
        index)) go in index order, where the job's first waiting one would: threads reach
        this point in no particular order, and the engine's batches then follow the input
        file, as `pipeline bench`'s do."""
        left = threading.Event()
        ticket = self._line_up(rank, shard)
        try:
            while True:
                with self._waiting_lock:
                    if self._waiting[0] == ticket and (stop() or self._may_enter()):
                        self._settling = self._settling_after(left, settle_s)
                        break
                self._wait(poll_s, while_waiting)
        finally:
            with self._waiting_lock:
                self._waiting.remove(ticket)
        try:
            yield
        finally:
            left.set()

    def _line_up(self, rank: int, shard: tuple[str, int] | None) -> tuple:
        """This shard's place among the waiting ones: (rank, its job's arrival, index, arrival,
        job id). Its job's arrival is that of the job's shards already waiting, if any (once
        none waits, a later shard of the job lines up as a new arrival)."""
        job, index = shard if shard is not None else (None, 0)
        with self._waiting_lock:
            arrival = next(self._arrivals)
            job_arrival = next((t[1] for t in self._waiting if job is not None and t[4] == job), arrival)
            ticket = (rank, job_arrival, index, arrival, job)   # arrival is unique: job ids are never compared
            bisect.insort(self._waiting, ticket)
        return ticket

    def _may_enter(self) -> bool:
        """Whether the last shard let in has settled and the batch has room."""
        if self._settling is not None and self._settling():
            return False
        loop = self._loop
        return loop is None or not loop.is_serving or loop.has_room

    def _settling_after(self, left: threading.Event, settle_s: float) -> Callable[[], bool]:
        """True until the shard entering now has put its requests in, left, or settle_s passed."""
        loop = self._loop
        deadline = time.monotonic() + settle_s
        if loop is None:   # the first shard builds the engine: the next waits for that
            return lambda: not left.is_set() and (
                self._building or (self._loop is None and time.monotonic() < deadline))
        before = loop.num_unfinished
        return lambda: not left.is_set() and loop.num_unfinished <= before and time.monotonic() < deadline

    @staticmethod
    def _wait(poll_s: float, while_waiting: Callable[[], None] | None) -> None:
        if while_waiting is not None:
            while_waiting()
        time.sleep(poll_s)

    def close(self) -> None:
        """Free the engine (its model and KV cache); the next use builds a new one."""
        with self._changed:
            self._changed.wait_for(lambda: self._users == 0)
            self._drop()

    def _build(self, config: EngineConfig) -> None:
        self._drop()
        from pipeline.engine import Engine  # torch: only once an engine is really needed
        from pipeline.engine_loop import EngineLoop
        self._key = key = engine_key(dataclasses.asdict(config))
        log.info("loading engine %s (model %s)", key, config.model or "bundled")   # tests count these
        start = time.monotonic()
        self._building = True
        try:
            self._loop, self._config = EngineLoop(lambda: Engine(config), observer=EngineObserver()), config
        finally:
            self._building = False
        metrics.count_engine_load(config.model)
        log.info("engine %s loaded in %.1f s", key, time.monotonic() - start)

    def _drop(self) -> None:
        # Free the old model and KV cache before allocating the new ones.
        if self._loop is None:
            return
        device = getattr(self._loop.engine, "device", None)   # what "auto" chose
        self._loop.close()
        self._loop = self._config = self._key = None
        gc.collect()
        if device is not None and device.type == "cuda":
            import torch
            torch.cuda.empty_cache()
