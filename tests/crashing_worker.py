"""A test-only Celery entry point (`celery -A tests.crashing_worker worker`): the real app
and tasks, except that a shard holding a request whose id starts with "crash-" kills its
worker process (os._exit) right after the engine's first result for it, every time.

It stands in for what no input can trigger deterministically (a segfault, the OOM
killer) and keeps the product code free of test hooks. The engine itself is the real one.
"""
from __future__ import annotations

import contextlib
import os

from workers import tasks
from workers.app import app  # noqa: F401  (what `celery -A` looks for)

__all__ = ["app"]   # (so pyflakes, which ignores noqa, sees it used too)

CRASH_PREFIX = "crash-"
_real_use = tasks.engines().use


class _CrashingEngine:
    def __init__(self, engine):
        self._engine = engine

    def generate(self, requests, should_stop=None):
        requests = list(requests)
        crash = any(r.id.startswith(CRASH_PREFIX) for r in requests)
        for out in self._engine.generate(requests, should_stop):
            if crash:
                os._exit(1)  # mid-shard: leased, a result made, nothing committed
            yield out
        if crash:
            os._exit(1)


@contextlib.contextmanager
def _crashing_use(options, fingerprint=None):
    with _real_use(options, fingerprint) as engine:
        yield _CrashingEngine(engine)


tasks.engines().use = _crashing_use
