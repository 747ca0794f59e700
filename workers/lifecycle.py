"""The worker's lifecycle: Celery signal handlers (the app's `include` connects them).

None of them builds an engine:
* worker_ready (main process): start the recovery thread;
* worker_shutting_down (main process, on SIGTERM/SIGINT — a warm shutdown): every
  running shard stops at its next engine step and is released (its attempt given back)
  and re-enqueued, so the warm shutdown ends within a step instead of after the shard.
  With a prefork pool the children are told with SIGUSR2; a child killed outright (e.g.
  the whole process group got SIGTERM) loses its shard to the reaper instead, which
  re-enqueues it once its lease expires — delayed, never lost;
* worker_process_init (prefork child): drop the parent's ledger connections, and take
  SIGUSR2 as the shutdown request.
"""
from __future__ import annotations

import os
import signal

from celery import signals

from workers import recovery
from workers.app import settings
from workers.shard_runner import request_shutdown


@signals.worker_ready.connect
def _start_recovery(sender=None, **_):
    recovery.start_thread(settings(),
                          worker_name=f"reaper@{getattr(sender, 'hostname', None) or 'worker'}:{os.getpid()}")


@signals.worker_shutting_down.connect
def _release_running_shards(sig=None, how=None, **_):
    request_shutdown()
    recovery.stop_thread()
    from billiard.process import active_children
    for child in active_children():  # prefork: the shards run in the children
        try:
            os.kill(child.pid, signal.SIGUSR2)
        except (ProcessLookupError, TypeError):
            pass


@signals.worker_process_init.connect
def _init_child(**_):
    recovery.forget_pool_after_fork()
    signal.signal(signal.SIGUSR2, lambda *_: request_shutdown())
