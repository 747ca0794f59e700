"""One engine per process, built on first use and shared by every shard running in it.

The engine is wrapped in an EngineLoop, so the shards in flight in this process (the
worker's threads, or `pipeline run`'s) feed one continuous batch: while one shard's last
requests drain, the next shard's already run beside them. A shard starts only when the
batch has room for it (room): small shards then run many at a time until the
batch is full, large ones about two at a time, and no shard is claimed only to wait.
"""
from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Callable, Iterator

from pipeline.config import EngineConfig
from workers.metrics import EngineObserver


class EngineHolder:
    """Hands out the process's engine loop for a job's engine options (EngineConfig fields).

    Building is lazy (never at import or fork: CUDA must not be initialised in a
    prefork parent) and happens again only when a shard asks for different options;
    that shard waits until the shards using the current engine are done, and shards for
    the current engine that arrive meanwhile wait behind it (no starvation).
    """

    def __init__(self):
        self._changed = threading.Condition()
        self._config: EngineConfig | None = None
        self._loop = None
        self._users = 0
        self._switches_pending = 0   # shards waiting for other options than the current engine's
        self._gate = threading.Lock()   # room: one shard enters at a time
        self._settling: Callable[[], bool] | None = None   # true until the last shard let in has started
        self._building = False

    @contextlib.contextmanager
    def use(self, options: dict) -> Iterator:
        """The engine loop for `options` (building or rebuilding it if needed), held until exit."""
        config = EngineConfig(**options)
        with self._changed:
            registered = False   # as a shard waiting for another engine
            try:
                while True:
                    current = self._loop is not None and self._loop.is_serving and config == self._config
                    if current and (registered or not self._switches_pending):
                        break
                    # Nobody holds the engine: (re)build it if needed; a shard for the current
                    # engine does not jump ahead of one waiting to switch.
                    if self._users == 0 and (not current or not self._switches_pending):
                        if not current:
                            self._build(config)
                        break
                    if not current and not registered:
                        self._switches_pending += 1
                        registered = True
                    self._changed.wait()
            finally:
                if registered:
                    self._switches_pending -= 1
            self._users += 1
            loop = self._loop
        try:
            yield loop
        finally:
            with self._changed:
                self._users -= 1
                self._changed.notify_all()

    @contextlib.contextmanager
    def room(self, stop: Callable[[], bool], while_waiting: Callable[[], None] | None = None,
             poll_s: float = 0.05, settle_s: float = 2.0) -> Iterator[None]:
        """Enter once the engine's batch has room for another shard's requests (or there
        is no engine yet, or stop() is true); hold it while the shard runs.

        Shards enter one at a time, each after the one before it has put its requests in
        (or has left: a duplicate that found its shard busy runs nothing), or settle_s
        passed, so a batch with room for a few requests does not let in every waiting
        shard. while_waiting() is called every poll while this shard waits (the task keeps
        its shard's place in the ledger with it)."""
        left = threading.Event()
        while not self._gate.acquire(timeout=poll_s):   # shards behind the one in the gate wait too
            if while_waiting is not None:
                while_waiting()
        try:
            while self._settling is not None and self._settling() and not stop():
                self._wait(poll_s, while_waiting)
            while not stop():
                loop = self._loop
                if loop is None or not loop.is_serving or loop.has_room:
                    break
                self._wait(poll_s, while_waiting)
            loop = self._loop
            deadline = time.monotonic() + settle_s
            if loop is None:   # the first shard builds the engine: the next waits for that
                self._settling = lambda: not left.is_set() and (
                    self._building or (self._loop is None and time.monotonic() < deadline))
            else:
                before = loop.num_unfinished
                self._settling = lambda: (not left.is_set() and loop.num_unfinished <= before
                                          and time.monotonic() < deadline)
        finally:
            self._gate.release()
        try:
            yield
        finally:
            left.set()

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
        self._building = True
        try:
            self._loop, self._config = EngineLoop(lambda: Engine(config), observer=EngineObserver()), config
        finally:
            self._building = False

    def _drop(self) -> None:
        # Free the old model and KV cache before allocating the new ones.
        if self._loop is None:
            return
        device = self._config.device
        self._loop.close()
        self._loop = self._config = None
        gc.collect()
        if device == "cuda":
            import torch
            torch.cuda.empty_cache()
