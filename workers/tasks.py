"""The shard task and enqueueing a job's shards.

The worker side reads the data root and the ledger URL from the environment
(jobs.paths: PIPELINE_DATA_DIR, PIPELINE_DATABASE_URL). PIPELINE_LEASE_SECONDS (default
60) and PIPELINE_MAX_ATTEMPTS (default 3) tune leasing.
"""
from __future__ import annotations

import functools
import os

import redis

from jobs import ledger, paths
from workers.app import app
from workers.engine_holder import EngineHolder
from workers.shard_runner import run_shard

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
    """Run one shard; retried once the lease has expired if it crashed or another worker held it."""
    try:
        outcome = run_shard(_session_factory(), paths.data_root(), job_id, index,
                            engine_provider=_engines.get, worker_name=f"{self.request.hostname}:{os.getpid()}",
                            lease_s=LEASE_S, max_attempts=MAX_ATTEMPTS)
    except Exception as exc:
        raise self.retry(exc=exc, countdown=LEASE_S + 5)
    if outcome == "busy":  # e.g. redelivered from a dead worker whose lease has not expired yet
        raise self.retry(countdown=LEASE_S + 5)
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
