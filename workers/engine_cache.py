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

from jobs.reuse.answer_key import engine_fingerprint
from pipeline.config import EngineConfig
from pipeline.engine_key import engine_key
from workers import metrics
from workers.metrics import EngineObserver

log = logging.getLogger(__name__)
RECHECK_S = 1.0   # has_work and the idle time change unannounced: a waiting shard looks again this often
_LOAD_TRIES = 3   # builds of one engine whose files keep changing while they load


class UnservedEngine(RuntimeError):
    """A shard for an engine this worker was not started for (routing sends none)."""


class EngineMismatch(RuntimeError):
    """A job names model files (its engine fingerprint, jobs.reuse.answer_key) that this process
    cannot load: its model directory holds other bytes than the submitter fingerprinted."""


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

    The engine answers only for the weights it loaded: each build fingerprints the model's
    files before and after loading them (jobs.reuse.answer_key.engine_fingerprint: a file
    replaced meanwhile means the build is done again), and a shard naming another
    fingerprint never runs on it. If the directory holds that shard's fingerprint now (the
    weights were replaced under a running worker, and the job was submitted after), the
    engine is rebuilt from them; otherwise the shard's attempt fails with EngineMismatch
    (the job was submitted for weights this worker does not have). So a row is always
    keyed under the weights that computed it, never the submitter's.
    """

    def __init__(self, served: list[dict] | tuple = (), has_work: Callable[[str], bool] | None = None,
                 switch_after_s: float = 10.0, tokenizer_processes: int | str = 0):
        self._served_options = list(served)
        self._served = {engine_key(options): EngineConfig(**options) for options in served}
        self._has_work, self._switch_after_s = has_work, switch_after_s
        self._tokenizer_processes = tokenizer_processes   # the engine loop's (PIPELINE_TOKENIZER_PROCESSES)
        self._changed = threading.Condition()
        self._config: EngineConfig | None = None
        self._key: str | None = None   # the loaded engine's key
        self._fingerprint: str | None = None   # the loaded engine's, by the files it read
        self._loop = None
        self._users = 0                # shards holding the loop, and a build in progress
        self._waiting = 0              # shards in use() waiting for the engine (to be free, built or kept)
        self._idle_since = time.monotonic()
        self.building = False          # a model is being built (read by the admission gate)

    @property
    def served_keys(self) -> list[str]:
        return list(self._served)

    @property
    def num_waiting(self) -> int:
        """Shards waiting in use() for the engine (another's in use, or being built)."""
        with self._changed:
            return self._waiting

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
    def use(self, options: dict, fingerprint: str | None = None) -> Iterator:
        """The engine loop for `options` (building or rebuilding it if needed), held until exit.
        fingerprint: the job's engine fingerprint (None: any); EngineMismatch when this
        process's model files are not those."""
        config = self.config_for(options)
        if fingerprint is not None and not (config == self._config and fingerprint == self._fingerprint):
            self._check_files(config, fingerprint)   # outside the lock: it may read the whole checkpoint
        with self._changed:
            while True:
                if (self._loop is not None and self._loop.is_serving and config == self._config
                        and fingerprint in (None, self._fingerprint)):
                    break   # the loaded engine: it goes first
                # A loaded engine of these options but older weights is stale: nothing waits for its queue.
                stale = config == self._config
                if self._users == 0 and not self.building and (stale or not self._keep_loaded()):
                    self._drop()
                    self.building = True
                    break
                self._waiting += 1
                try:
                    self._changed.wait(timeout=RECHECK_S)
                finally:
                    self._waiting -= 1
            self._users += 1
            build = self.building and self._loop is None
        try:
            if build:
                self._build(config)
            if fingerprint not in (None, self._fingerprint):   # the files changed again while it loaded
                raise EngineMismatch(_mismatch(config, fingerprint, self._fingerprint))
            yield self._loop
        finally:
            with self._changed:
                self._users -= 1
                if self._users == 0:
                    self._idle_since = time.monotonic()
                self._changed.notify_all()

    @staticmethod
    def _check_files(config: EngineConfig, fingerprint: str) -> None:
        """EngineMismatch unless the model's files here are those of `fingerprint`."""
        here = engine_fingerprint(dataclasses.asdict(config))
        if here != fingerprint:
            raise EngineMismatch(_mismatch(config, fingerprint, here))

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
        options = dataclasses.asdict(config)
        key = engine_key(options)
        log.info("loading engine %s (model %s)", key, config.model or "bundled")   # tests count these
        start = time.monotonic()
        try:
            for _ in range(_LOAD_TRIES):
                before = engine_fingerprint(options)
                loop = EngineLoop(lambda: build_engine(config), observer=EngineObserver(),
                                  tokenizer_processes=self._tokenizer_processes)
                fingerprint = engine_fingerprint(options)
                if fingerprint == before:
                    break
                log.warning("the files of model %s changed while it loaded: loading it again",
                            config.model or "bundled")
                loop.close()
            else:
                fingerprint = None   # they never held still: no job naming a fingerprint runs on it
            with self._changed:
                self._loop, self._config, self._key, self._fingerprint = loop, config, key, fingerprint
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
        self._loop = self._config = self._key = self._fingerprint = None
        gc.collect()
        if device is not None and device.type == "cuda":
            import torch
            torch.cuda.empty_cache()


def _mismatch(config: EngineConfig, wanted: str, here: str | None) -> str:
    model = config.model or "the bundled model"
    return (f"the job was submitted for model files with engine fingerprint {wanted}, but {model} here has "
            f"{here or 'files that cannot be fingerprinted'}: its weights, config or tokenizer changed since the "
            "job was submitted, or differ between the submitter and this worker; resubmit the job "
            "(`pipeline retry JOB`) to run it on the files the workers have now")
