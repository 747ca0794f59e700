"""The engines a process serves, one loaded at a time and shared by every shard running in it.

The engine is wrapped in an EngineLoop, so the shards in flight in this process (the
worker's threads, or `pipeline run`'s) feed one continuous batch: while one shard's last
requests drain, the next shard's already run beside them. When a shard may start is the
admission gate's decision (workers.admission), not this cache's.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator

from pipeline.config import EngineConfig
from pipeline.engine_key import engine_key
from workers import metrics
from workers.metrics import EngineObserver

log = logging.getLogger(__name__)
RECHECK_S = 1.0   # has_work and the idle time change unannounced: a waiting shard looks again this often


class UnservedEngine(RuntimeError):
    """A shard for an engine this worker was not started for (routing sends none)."""


class EngineCache:
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

    One lock (a condition) guards the state, and the model is built outside it: the
    shards that wait meanwhile see `building` and wait on the condition, not on a lock.
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
        self._users = 0                # shards holding the loop, and a build in progress
        self._idle_since = time.monotonic()
        self.building = False          # a model is being built (read by the admission gate)

    @property
    def served_keys(self) -> list[str]:
        return list(self._served)

    @property
    def loop(self):
        """The loaded engine loop, or None (a snapshot, read without the lock)."""
        return self._loop

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
                if self._users == 0 and not self.building and not self._keep_loaded():
                    self._drop()
                    self.building = True
                    break
                self._changed.wait(timeout=RECHECK_S)
            self._users += 1
            build = self.building and self._loop is None
        try:
            if build:
                self._build(config)
            yield self._loop
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

    def close(self) -> None:
        """Free the engine (its model and KV cache); the next use builds a new one."""
        with self._changed:
            self._changed.wait_for(lambda: self._users == 0)
            self._drop()

    def _build(self, config: EngineConfig) -> None:
        """Build the engine, outside the lock (this caller is counted as a user, so nobody
        drops or builds meanwhile); `building` ends however it goes."""
        from pipeline.engine.factory import build_engine  # torch: only once an engine is really needed
        from pipeline.engine.engine_loop import EngineLoop
        key = engine_key(dataclasses.asdict(config))
        log.info("loading engine %s (model %s)", key, config.model or "bundled")   # tests count these
        start = time.monotonic()
        try:
            loop = EngineLoop(lambda: build_engine(config), observer=EngineObserver())
            with self._changed:
                self._loop, self._config, self._key = loop, config, key
        finally:
            with self._changed:
                self.building = False
                self._changed.notify_all()
        metrics.count_engine_load(config.model)
        log.info("engine %s loaded in %.1f s", key, time.monotonic() - start)

    def _drop(self) -> None:
        """Free the old model and KV cache before allocating the new ones (lock held, no user)."""
        if self._loop is None:
            return
        device = getattr(self._loop.engine, "device", None)   # what "auto" chose
        self._loop.close()
        self._loop = self._config = self._key = None
        gc.collect()
        if device is not None and device.type == "cuda":
            import torch
            torch.cuda.empty_cache()
