"""The broker side of a job: is Redis there, send shards to it, how many wait in it.

Shards are sent by task name (`app.send_task`), so producers (the CLI, recovery, a
worker handing back its shard) never import the tasks module: the imports run one way,
tasks -> recovery -> broker -> app.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

import redis

from jobs.settings import Settings, env_var

RUN_SHARD = "pipeline.run_shard"  # the name workers.tasks registers the shard task under


class BrokerUnavailable(RuntimeError):
    """The broker cannot be reached; the message says what to do about it."""


def check_broker(url: str, timeout_s: float = 2.0) -> None:
    """Raise BrokerUnavailable unless the Redis at url answers a ping within timeout_s."""
    try:
        redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s).ping()
    except (redis.RedisError, OSError) as e:
        raise BrokerUnavailable(
            f"cannot reach the broker at {url} ({e}).\n"
            "Start Redis (e.g. `redis-server --daemonize yes`, or `docker compose up -d redis`), "
            f"point {env_var('broker_url')} at it, or run the job without workers: `pipeline run FILE`."
        ) from None


def enqueue_shards(settings: Settings, shards: Iterable[tuple[str, int]]) -> None:
    """Send one shard task per (job_id, index) to the settings' broker and queue."""
    from workers.app import app  # Celery only where a message is sent: recovery imports no Celery

    with app.connection_for_write(settings.broker_url) as conn, conn.Producer() as producer:
        for job_id, index in shards:
            app.send_task(RUN_SHARD, (job_id, index), queue=settings.queue, producer=producer,
                          argsrepr=shard_repr(job_id, index))


def shard_repr(job_id: str, index: int) -> str:
    """How a shard task's arguments read in Flower and in the worker's log (see SHARD_REPR)."""
    return f"(job_id={job_id!r}, shard={index})"


SHARD_REPR = re.compile(r"\(job_id='(?P<job_id>job_[0-9a-f]+)', shard=(?P<shard>\d+)\)")


def enqueue_job(settings: Settings, job_id: str, num_shards: int) -> None:
    """Check the broker, then send every shard of a job."""
    check_broker(settings.broker_url)
    enqueue_shards(settings, ((job_id, index) for index in range(num_shards)))


def backlog(settings: Settings, queue: str | None = None) -> int:
    """Messages waiting in a Redis queue, the settings' by default (not those delivered and
    unacknowledged)."""
    client = redis.Redis.from_url(settings.broker_url, socket_connect_timeout=5, socket_timeout=5)
    try:
        return int(client.llen(queue or settings.queue))
    finally:
        client.close()
