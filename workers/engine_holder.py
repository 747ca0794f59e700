"""One engine per process, built on first use and shared by every shard running in it.

The engine is wrapped in an EngineLoop, so the shards in flight in this process (the
worker's threads, or `pipeline run`'s) feed one continuous batch: while one shard's last
requests drain, the next shard's already run beside them.
"""
from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

from pipeline.config import EngineConfig


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

    def close(self) -> None:
        """Free the engine (its model and KV cache); the next use builds a new one."""
        with self._changed:
            self._changed.wait_for(lambda: self._users == 0)
            self._drop()

    def _build(self, config: EngineConfig) -> None:
        self._drop()
        from pipeline.engine import Engine  # torch: only once an engine is really needed
        from pipeline.engine_loop import EngineLoop
        self._loop, self._config = EngineLoop(Engine(config)), config

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
