"""The shard task, enqueueing a job's shards, and the worker's lifecycle hooks.

The worker side reads the data root and the ledger URL from the environment
(jobs.paths: PIPELINE_DATA_DIR, PIPELINE_DATABASE_URL). PIPELINE_LEASE_SECONDS (default
60) and PIPELINE_MAX_ATTEMPTS (default 3) tune leasing; PIPELINE_RECOVERY_INTERVAL and
PIPELINE_QUEUED_GRACE_SECONDS tune the recovery thread (workers.recovery).

Lifecycle (Celery signals; none of them builds an engine):
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

import functools
import logging
import os
import signal

import redis
from celery import signals

from jobs import ledger, paths
from workers import recovery
from workers.app import app
from workers.engine_holder import EngineHolder
from workers.shard_runner import request_shutdown, run_shard

log = logging.getLogger(__name__)

LEASE_S = float(os.environ.get("PIPELINE_LEASE_SECONDS") or 60)
MAX_ATTEMPTS = int(os.environ.get("PIPELINE_MAX_ATTEMPTS") or 3)
_engines = EngineHolder()  # empty until the first task: nothing is built in a prefork parent


class BrokerUnavailable(RuntimeError):
    """The broker cannot be reached; the message says what to do about it."""


@functools.cache
def _session_factory():
    # Made on first use, so each worker process gets its own connection pool.
    return ledger.session_factory(ledger.make_engine(paths.database_url()))


@app.task(bind=True, name="pipeline.run_shard", max_retries=MAX_ATTEMPTS + 1)
def run_shard_task(self, job_id: str, index: int) -> str:
    """Run one shard; retried once the lease has expired if it crashed.

    A duplicate delivery (Redis redelivers a message whose visibility timeout passed
    while its first copy still runs; the reconciler re-enqueues) finds the shard held
    ("busy") or done ("skipped") and is simply acknowledged: the holder finishes it, or
    the reaper re-enqueues it once the holder's lease expires.
    """
    try:
        outcome = run_shard(_session_factory(), paths.data_root(), job_id, index,
                            engine_provider=_engines.get, worker_name=f"{self.request.hostname}:{os.getpid()}",
                            lease_s=LEASE_S, max_attempts=MAX_ATTEMPTS)
    except Exception as exc:
        raise self.retry(exc=exc, countdown=LEASE_S + 5)
    if outcome == "released":  # this worker is shutting down: hand the shard to another one
        try:
            recovery.enqueue_shards([(job_id, index)])
        except Exception:  # it is queued in the ledger: the reconciler re-enqueues it
            log.warning("re-enqueueing released shard %s/%d failed", job_id, index, exc_info=True)
    return outcome


def check_broker(url: str, timeout_s: float = 2.0) -> None:
    """Raise BrokerUnavailable unless the Redis at url answers a ping within timeout_s."""
    try:
        redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s).ping()
    except (redis.RedisError, OSError) as e:
        raise BrokerUnavailable(
            f"cannot reach the broker at {url} ({e}).\n"
            "Start Redis (e.g. `redis-server --daemonize yes`, or `docker compose up -d redis`), "
            "point PIPELINE_BROKER_URL at it, or run the job without workers: `pipeline run FILE`."
        ) from None


def enqueue_job(job_id: str, num_shards: int, url: str | None = None) -> None:
    """Send one task per shard to the broker at url (default: the app's)."""
    url = url or app.conf.broker_url
    check_broker(url)
    with app.connection_for_write(url) as conn, conn.Producer() as producer:
        for index in range(num_shards):
            run_shard_task.apply_async((job_id, index), producer=producer)


# --- worker lifecycle -------------------------------------------------------------------------

@signals.worker_ready.connect
def _start_recovery(sender=None, **_):
    recovery.start_thread(max_attempts=MAX_ATTEMPTS, lease_s=LEASE_S,
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
