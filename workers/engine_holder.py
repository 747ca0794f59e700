"""One engine per process, built on first use and kept for every shard that wants the same options."""
from __future__ import annotations

import gc
import threading

from pipeline.config import EngineConfig


class EngineHolder:
    """Hands out the process's engine for a job's engine options (EngineConfig fields).

    Building is lazy (never at import or fork: CUDA must not be initialised in a
    prefork parent) and happens again only when a job asks for different options.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._config: EngineConfig | None = None
        self._engine = None

    def get(self, options: dict):
        """The engine for `options`, building or rebuilding it if needed."""
        config = EngineConfig(**options)
        with self._lock:
            if self._engine is None or config != self._config:
                self._drop()
                from pipeline.engine import Engine  # torch: only once an engine is really needed
                self._engine, self._config = Engine(config), config
            return self._engine

    def _drop(self) -> None:
        # Free the old model and KV cache before allocating the new ones.
        if self._engine is None:
            return
        device = self._config.device
        self._engine = self._config = None
        gc.collect()
        if device == "cuda":
            import torch
            torch.cuda.empty_cache()
