"""Recovery: the reaper and the reconciler that make "nothing lost" hold.

Celery on Redis delivers at least once, and the ledger turns that into exactly-once
results (claim with attempt + lease, fenced commit). What remains is the shards that
nobody is working on any more although they are not finished:

* a worker died mid-shard (SIGKILL, OOM, power): its lease expires. The reaper
  (ledger.expired_shards) puts the shard back to queued and re-enqueues it; once its
  attempts are used up it writes one error row per request instead, commits the shard
  as failed and finalizes the job, so the job still ends with every request answered;
* the broker lost messages (Redis restarted without persistence, a publish that failed):
  shards stay queued with no message. The reconciler re-enqueues shards queued longer
  than a grace period, at most once per grace period for all reconcilers together
  (ledger.touch_queued), and only while its engine key's queue is empty, so a long queue
  of shards that are merely waiting is not flooded with duplicates (a worker holding a
  shard's message while it waits for room keeps its clock fresh, workers.tasks).
  Duplicates are harmless anyway: claiming is conditional;
* a job past its completion window is expired here (ledger.expire_if_due), also when no
  worker holds it, and finalized: it ends "expired";
* a job whose shards all ended but whose finalizer died is finalized here;
  shards of a cancelling job that went back to queued are cancelled;
* result files of attempts that can never commit are removed from results/_tmp;
* retention: the results of jobs past their keep (`--keep`, output_expires_after,
  PIPELINE_KEEP_RESULTS), with their index entries and batch output files, and API files
  past their expires_at are deleted (jobs.results.retention.expire_results, `pipeline gc`'s
  deletion); the job row stays, marked results_expired_at.
* (beside it) jobs that ended with a webhook endpoint get their events posted
  (workers.webhook_sender): by a thread of their own on a worker, after the pass in
  `pipeline recover`.

`recover` is one pass. Every worker runs it every PIPELINE_RECOVERY_INTERVAL seconds
(default 30; 0 turns it off) in a daemon thread of its main process (started on Celery's
worker_ready signal by workers.lifecycle; it never builds an engine), and `pipeline
recover` runs one pass (for cron, or with no worker left). Passes in many processes at
once are safe: every step is a conditional ledger update that one caller wins.
"""
from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable

from sqlalchemy.orm import Session, sessionmaker

from jobs import ledger
from jobs.results.finalize import finalize_job, refinalize_job
from jobs.results.retention import expire_results
from jobs.ledger import ShardStatus
from jobs.paths import JobPaths
from jobs.scheduling import DEFAULT_PRIORITY
from jobs.settings import Settings
from workers import broker, metrics, webhook_sender
from workers.periodic import PeriodicThread
from workers.shard_runner import commit_error_rows

log = logging.getLogger(__name__)

DEFAULT_FINALIZE_GRACE_S = 300.0

# (route, shards of jobs with that route): sends them to `<route.queue>.<route.engine_key>`
Enqueue = Callable[[ledger.Route, list[tuple[str, int]]], None]
# The number of messages waiting on a route's queue.
Backlog = Callable[[ledger.Route], int]


def recover_with_broker(settings: Settings, Session: sessionmaker[Session], *, worker_name: str | None = None,
                        webhooks: bool = True) -> dict:
    """One pass with the settings' attempts, grace and lease, sending to the settings' broker;
    then, with webhooks, one webhook pass (report["webhooks"]: workers.webhook_sender.send_due's;
    a receiver that is down is no recovery error). The recovery thread passes webhooks=False:
    its sender thread posts them, so that no receiver's timeout delays a recovery pass."""
    report = recover(Session, settings.data_dir, max_attempts=settings.max_attempts,
                     queued_grace_s=settings.queued_grace_s, lease_s=settings.lease_s, worker_name=worker_name,
                     enqueue=lambda route, shards: broker.enqueue_shards(
                         settings, route.engine_key, shards, route.priority, prefix=route.queue),
                     backlog=lambda route: broker.backlog(settings, settings.queue_for(route.engine_key, route.queue)))
    if webhooks:
        report["webhooks"] = _guard(report, "webhooks", webhook_sender.send_due, Session, settings.webhook_backoff_s)
    return report


def recover(
    Session: sessionmaker[Session], root, *, max_attempts: int, queued_grace_s: float,
    enqueue: Enqueue, backlog: Backlog, lease_s: float = 60.0, finalize_grace_s: float = DEFAULT_FINALIZE_GRACE_S,
    worker_name: str | None = None,
) -> dict:
    """One recovery pass over the whole ledger; returns what it did.

    enqueue(route, shards) sends one task per (job_id, index) on their jobs' route
    (ledger.Route: the queue prefix the job was submitted on and its engine key, so each
    shard goes back to its own job's queue, never another, with the job's priority);
    backlog(route) is the number of messages waiting in that queue — the reconciler
    re-sends a route's shards only when it is 0.
    An enqueue that fails (broker down) is logged and left to a later pass: the shards
    are queued in the ledger, so the reconciler finds them.

    The report: expired (jobs whose completion window passed, now expiring), requeued (expired leases, re-enqueued), exhausted (committed as failed
    with error rows), cancelled (queued shards of cancelling jobs), reenqueued
    (reconciled), finalized (job ids), tmp_removed (files), results_expired (jobs whose
    results went, their keep passed), files_expired (API files past their expires_at), errors (messages).
    """
    worker_name = worker_name or f"reaper@{socket.gethostname()}:{os.getpid()}"
    report: dict = {"expired": [], "requeued": [], "exhausted": [], "cancelled": [], "reenqueued": [],
                    "finalized": [], "tmp_removed": 0, "results_expired": [], "files_expired": [], "errors": []}
    touched: set[str] = set()

    # jobs past their completion window, even those no worker holds: queued shards never
    # run; the running ones stop at their next step (their workers poll the same status)
    with Session() as s:
        report["expired"] = ledger.expire_if_due(s)
    touched.update(report["expired"])

    # (a) the reaper
    with Session() as s:
        requeued, exhausted = ledger.expired_shards(s, max_attempts)
    report["requeued"] = requeued
    touched.update(job_id for job_id, _ in requeued)
    if requeued:
        with Session() as s:  # queued as of now: no reconciler re-sends them within the grace period
            for job_id, index in requeued:
                ledger.touch_queued(s, job_id, index, 0)
    _send(Session, enqueue, requeued, report)
    for job_id, index in exhausted:
        try:
            if _fail_exhausted(Session, root, job_id, index, max_attempts, worker_name, lease_s):
                report["exhausted"].append((job_id, index))
                touched.add(job_id)
        except Exception as e:  # one broken shard must not stop the pass
            log.exception("recovery: failing exhausted shard %s/%d failed", job_id, index)
            report["errors"].append(f"{job_id}/{index}: {type(e).__name__}: {e}")

    # shards that went back to queued in a cancelling job can never run: cancel them
    with Session() as s:
        report["cancelled"] = ledger.cancel_orphaned_shards(s)
    touched.update(job_id for job_id, _ in report["cancelled"])

    # (b) the reconciler, per queue: only the shards of routes whose queue is empty
    with Session() as s:
        candidates = ledger.queued_shards(s, older_than_s=queued_grace_s)
        routes = ledger.shard_routes(s, candidates)   # each shard's own queue (a several-model job's differ)
    idle: dict[tuple, bool] = {}   # (queue, engine key) -> nothing waits in it
    for route in sorted(set(routes.values()), key=str):
        queue = route[:2]
        if queue in idle:
            continue
        try:
            idle[queue] = route.engine_key is not None and backlog(route) == 0
        except Exception as e:
            idle[queue] = False
            report["errors"].append(f"reading the queue length of engine {route.engine_key} failed: "
                                    f"{type(e).__name__}: {e}")
    with Session() as s:
        lost = [(job_id, index) for job_id, index in candidates
                if (job_id, index) in routes and idle[routes[job_id, index][:2]]
                and ledger.touch_queued(s, job_id, index, queued_grace_s)]
    report["reenqueued"] = lost
    _send(Session, enqueue, lost, report)

    # (c) jobs nobody finalized: shards all ended, or a finalizer that died half-way
    with Session() as s:
        candidates = sorted(touched | set(ledger.unfinalized_jobs(s)))
        stale = ledger.stale_finalizing_jobs(s, finalize_grace_s)
    for job_id in candidates:
        if _guard(report, job_id, finalize_job, Session, root, job_id):
            report["finalized"].append(job_id)
    for job_id in stale:
        if _guard(report, job_id, refinalize_job, Session, root, job_id, finalize_grace_s):
            report["finalized"].append(job_id)

    # leftovers of attempts that can never commit
    with Session() as s:
        active = ledger.active_jobs(s)
    for job_id in sorted(set(active) | touched | set(report["finalized"])):
        report["tmp_removed"] += _guard(report, job_id, sweep_tmp, Session, root, job_id) or 0

    # retention: what is past its keep
    report.update(_guard(report, "retention", expire_results, Session, root) or {})
    return report


def sweep_tmp(Session: sessionmaker[Session], root, job_id: str) -> int:
    """Delete the job's results/_tmp files of attempts that can no longer commit.

    A worker attempt's file can commit only while its attempt is the shard's current one
    and the shard is running; a reaper's file only while the shard is running. (A file
    deleted under a racing writer only makes that writer's commit fail; it cannot make a
    wrong one succeed.) Returns the number of files removed.
    """
    files = JobPaths(root, job_id).tmp_results()
    if not files:
        return 0
    with Session() as s:
        shards = {sh.index: sh for sh in ledger.get_shards(s, job_id)}
    removed = 0
    for path, (index, attempt, by_reaper) in files:
        shard = shards.get(index)
        running = shard is not None and shard.status == ShardStatus.RUNNING
        live = running and (by_reaper or attempt == shard.attempt)
        if shard is None or attempt > shard.attempt or live:
            continue
        path.unlink(missing_ok=True)
        removed += 1
    return removed


def _fail_exhausted(Session, root, job_id: str, index: int, max_attempts: int, worker: str, lease_s: float) -> bool:
    """Commit an exhausted shard as failed with an error row per request; True if this call did."""
    with Session() as s:
        shard = ledger.get_shard(s, job_id, index)
        if shard is None or shard.status != ShardStatus.RUNNING:
            return False
        attempt, last_worker, num_requests = shard.attempt, shard.worker, shard.num_requests
        last_error = shard.error   # what the last attempt raised, when it said (ledger.note_shard_error)
        if not ledger.take_over_expired(s, job_id, index, attempt, worker, lease_s):
            return False  # another reaper, or the worker came back to life
        model = ledger.get_job(s, job_id).model
    if last_error:
        error = (f"the shard failed on each of its {max_attempts} attempts (last on {last_worker}); "
                 f"last error: {last_error}; the shard is given up")
    else:
        error = (f"the shard's worker stopped responding on each of its {max_attempts} attempts "
                 f"(last: {last_worker}); the shard is given up")
    log.warning("recovery: shard %s/%d: %s", job_id, index, error)
    tmp = JobPaths(root, job_id).tmp_result(index, attempt, by_reaper=True)
    try:
        committed = commit_error_rows(Session, root, job_id, index, attempt, error, tmp_path=tmp)
    except (OSError, ValueError) as e:  # the input shard is gone or unreadable: no rows to write
        # (the job's finalizer writes them if it can read the input, or fails the job)
        with Session() as s:
            committed, num_requests = ledger.fail_shard(s, job_id, index, attempt,
                                                        f"{error}; reading its input failed: {e}"), 0
    if committed:
        metrics.count_given_up_shard(model, num_requests)
    return committed


def _send(Session, enqueue: Enqueue, shards: list[tuple[str, int]], report: dict) -> None:
    """Send shards on their routes (the queue each job was submitted on; its shard's engine's)."""
    if not shards:
        return
    with Session() as s:
        routes = ledger.shard_routes(s, shards)
    by_route: dict[ledger.Route, list[tuple[str, int]]] = {}
    for job_id, index in shards:
        route = routes.get((job_id, index), ledger.Route(None, None, DEFAULT_PRIORITY))
        by_route.setdefault(route._replace(priority=route.priority or DEFAULT_PRIORITY), []).append((job_id, index))
    for route, group in by_route.items():
        try:
            if route.engine_key is None:
                raise ValueError("its job has no engine key (its engine options are not valid any more)")
            enqueue(route, group)
        except Exception as e:  # the shards are queued in the ledger: the reconciler sends them later
            log.warning("recovery: enqueueing %d shard(s) failed: %s", len(group), e)
            report["errors"].append(f"enqueueing {len(group)} shard(s) failed: {type(e).__name__}: {e}")


def _guard(report: dict, job_id: str, fn, *args):
    try:
        return fn(*args)
    except Exception as e:
        log.exception("recovery: %s(%s) failed", fn.__name__, job_id)
        report["errors"].append(f"{job_id}: {fn.__name__}: {type(e).__name__}: {e}")
        return None


def log_pass(settings: Settings, Session: sessionmaker[Session], worker_name: str | None) -> None:
    """One pass without webhooks (their own thread sends them), what it did logged."""
    report = recover_with_broker(settings, Session, worker_name=worker_name, webhooks=False)
    done = {k: v for k, v in report.items() if v and k != "errors"}
    if done:
        log.info("recovery: %s", done)
    for error in report["errors"]:
        log.warning("recovery: %s", error)


_thread: PeriodicThread | None = None
_sender: PeriodicThread | None = None   # the webhook sender, started with it


def start_thread(settings: Settings, worker_name: str | None = None) -> PeriodicThread | None:
    """Start this process's recovery thread and webhook sender thread (once) unless the
    interval is 0: a slow webhook receiver must not delay recovery."""
    global _thread, _sender
    if _thread is not None or settings.recovery_interval_s <= 0:
        return _thread
    _thread = PeriodicThread(settings, "recovery",
                             lambda Session: log_pass(settings, Session, worker_name)).start()
    _sender = PeriodicThread(settings, "webhooks",
                             lambda Session: webhook_sender.log_pass(Session, settings.webhook_backoff_s)).start()
    log.info("recovery and webhook threads started: a pass every %.3g s", settings.recovery_interval_s)
    return _thread


def stop_thread() -> None:
    for thread in (_thread, _sender):
        if thread is not None:
            thread.stop()


def forget_pool_after_fork() -> None:
    """In a forked child: drop the parent's ledger connections without closing them."""
    for thread in (_thread, _sender):
        if thread is not None and thread.Session is not None:
            thread.Session.kw["bind"].dispose(close=False)
