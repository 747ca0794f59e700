"""The shard task: ids in, the shard runner does the work; nothing else lives here.

Settings (lease, attempts, data root, ledger) come from the app (workers.app.settings);
the worker's signal handlers are in workers.lifecycle; producers send this task by name
(workers.broker), so they never import this module.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable

from jobs import ledger
from jobs.scheduling import priority_rank
from workers import broker
from workers.app import app, settings
from workers.admission import AdmissionGate
from workers.engine_cache import EngineCache
from workers.shard_runner import ShardOutcome, run_shard, shutting_down

log = logging.getLogger(__name__)


def _has_work(engine_key: str) -> bool:
    """Whether the queue of a served engine still holds shards (EngineCache's switch rule)."""
    cfg = settings()
    return broker.backlog(cfg, cfg.queue_for(engine_key)) > 0


_engines: EngineCache | None = None
_gate: AdmissionGate | None = None
_making = threading.Lock()   # shard threads and the preload thread may ask first at once


def engines() -> EngineCache:
    """The engines this worker process serves (PIPELINE_WORKER_ENGINES), made on first use;
    no model is built before a shard or the preload asks, so never in a prefork parent:
    workers.lifecycle preloads the first after the fork."""
    global _engines
    with _making:
        if _engines is None:
            _engines = EngineCache(served=settings().served_engine_options(), has_work=_has_work,
                                   tokenizer_processes=settings().tokenizer_processes)
        return _engines


def gate() -> AdmissionGate:
    """This process's admission gate in front of its engines (one, for every shard thread)."""
    global _gate
    cache = engines()
    with _making:
        if _gate is None:
            _gate = AdmissionGate(cache)
        return _gate


def preload_engine() -> None:
    """Build this process's first served engine (a worker at start-up, in a thread); a model that
    fails to load is logged here, and each shard then fails and is retried as before."""
    try:
        engines().preload()
    except Exception:
        log.exception("loading the engine at start-up failed; shards will try again")


@functools.cache
def _session_factory(database_url: str):
    # Made on first use, so each worker process gets its own connection pool.
    return ledger.session_factory(ledger.make_engine(database_url))


@app.task(bind=True, name=broker.RUN_SHARD)
def run_shard_task(self, job_id: str, index: int) -> str:
    """Run one shard; retried once the lease has expired if it crashed.

    A duplicate delivery (Redis redelivers a message whose visibility timeout passed
    while its first copy still runs; the reconciler re-enqueues) finds the shard held
    ("busy") or done ("skipped") and is simply acknowledged: the holder finishes it, or
    the reaper re-enqueues it once the holder's lease expires.
    """
    cfg = settings()
    Session = _session_factory(cfg.database_url)
    # The job's priority came with the message (workers.broker): no ledger read for it.
    priority = broker.priority_of_message((self.request.delivery_info or {}).get("priority"))

    def run() -> ShardOutcome:
        return run_shard(Session, cfg.data_dir, job_id, index, engine_provider=engines().use,
                         worker_name=f"{self.request.hostname}:{os.getpid()}",
                         lease_s=cfg.lease_s, max_attempts=cfg.max_attempts)

    try:
        # Several shard tasks run at once in a worker (threads); each claims its shard only
        # once the engine's batch has room for it, so a waiting shard holds no lease. While
        # it waits, its shard is queued in the ledger with its message here: it keeps the
        # shard's queued clock fresh, or the reconciler would take the message for lost.
        # A duplicate of a shard that is not queued (running, done) does not wait: it goes
        # straight to run_shard, which finds it busy or skipped. Waiting shards enter by
        # priority (rank), then in the order they arrived, one job's in index order: a
        # high-priority shard reserved behind low ones starts at the next shard boundary.
        if _keep_queued(Session, job_id, index):
            keep = _every(cfg.queued_grace_s / 3, lambda: _keep_queued(Session, job_id, index))
            with gate().room(stop=shutting_down, while_waiting=keep, rank=priority_rank(priority),
                               shard=(job_id, index)):
                outcome = run()
        else:
            outcome = run()
    except Exception as exc:
        raise self.retry(exc=exc, countdown=cfg.lease_s + 5, max_retries=cfg.max_attempts + 1)
    if outcome == ShardOutcome.RELEASED:  # this worker is shutting down: hand the shard to another one
        try:
            with Session() as s:
                route = ledger.shard_routes(s, [(job_id, index)])[job_id, index]   # its own engine's queue
            broker.enqueue_shards(cfg, route.engine_key, [(job_id, index)], priority, prefix=route.queue)
        except Exception:  # it is queued in the ledger: the reconciler re-enqueues it
            log.warning("re-enqueueing released shard %s/%d failed", job_id, index, exc_info=True)
    return outcome


def _keep_queued(Session, job_id: str, index: int) -> bool:
    """Restart a queued shard's waiting clock (a message for it is here); False if it is
    not queued. A database hiccup counts as queued: the claim decides anyway."""
    try:
        with Session() as s:
            return ledger.touch_queued(s, job_id, index, 0)
    except Exception:
        log.warning("touching queued shard %s/%d failed", job_id, index, exc_info=True)
        return True


def _every(period_s: float, fn: Callable[[], object]) -> Callable[[], None]:
    """fn, called at most once every period_s seconds (the first call waits a period)."""
    next_at = time.monotonic() + period_s

    def call() -> None:
        nonlocal next_at
        if time.monotonic() >= next_at:
            next_at = time.monotonic() + period_s
            fn()
    return call
