"""The broker side of a job: is Redis there, send shards to their engine's queue, how many
wait in it, which engines live workers serve.

Priorities are kombu's message priorities on Redis: each engine key's queue is one Redis
list per priority step (PRIORITY_STEPS; `<queue>` for step 0, `<queue>\x06\x16<step>` for
the others), and a worker's BRPOP names every step of every queue it consumes, lowest step
first, so it takes the oldest message of the highest priority there is (FIFO within a
priority: each list is first-in first-out). A job's priority maps to a step
(MESSAGE_PRIORITY: high 0, normal 3, low 6; on Redis a lower number goes first).

Shards are sent by task name (`app.send_task`), so producers (the CLI, recovery, a
worker handing back its shard) never import the tasks module: the imports run one way,
tasks -> recovery -> broker -> app (the app takes the priority steps from jobs.scheduling,
not from here).
"""
from __future__ import annotations

import re
import time
from collections.abc import Iterable

import redis

from jobs.scheduling import DEFAULT_PRIORITY, MESSAGE_PRIORITY, PRIORITY_STEPS
from jobs.settings import Settings, env_var

RUN_SHARD = "pipeline.run_shard"  # the name workers.tasks registers the shard task under

_KOMBU_SEP = "\x06\x16"   # kombu.transport.redis.Channel.sep
_PUBLISH_BATCH = 1000       # messages sent in one Redis pipeline (kombu >= 5.7 Producer.batch)


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


def enqueue_shards(settings: Settings, engine_key: str, shards: Iterable[tuple[str, int]],
                   priority: str = DEFAULT_PRIORITY, prefix: str | None = None) -> None:
    """Send one shard task per (job_id, index) to the queue of engine_key (their jobs' key),
    with their jobs' priority; prefix: their jobs' PIPELINE_QUEUE when it is not ours."""
    from workers.app import app  # Celery only where a message is sent: recovery imports no Celery

    queue = settings.queue_for(engine_key, prefix)
    step = MESSAGE_PRIORITY[priority]
    with app.connection_for_write(settings.broker_url) as conn, conn.Producer() as producer, \
            producer.batch(max_size=_PUBLISH_BATCH):
        for job_id, index in shards:
            app.send_task(RUN_SHARD, (job_id, index), queue=queue, producer=producer, priority=step,
                          argsrepr=shard_repr(job_id, index))


def priority_of_message(step: int | None) -> str:
    """The job priority a delivered message was sent with (its delivery_info's priority)."""
    return next((name for name, s in MESSAGE_PRIORITY.items() if s == step), DEFAULT_PRIORITY)


def shard_repr(job_id: str, index: int) -> str:
    """How a shard task's arguments read in Flower and in the worker's log (see SHARD_REPR)."""
    return f"(job_id={job_id!r}, shard={index})"


SHARD_REPR = re.compile(r"\(job_id='(?P<job_id>job_[0-9a-f]+)', shard=(?P<shard>\d+)\)")


def enqueue_job(settings: Settings, job_id: str, num_shards: int, engine_key: str,
                priority: str = DEFAULT_PRIORITY, prefix: str | None = None) -> None:
    """Check the broker, then send every shard of a job to its engine key's queue (under
    prefix, the job's PIPELINE_QUEUE, when given)."""
    check_broker(settings.broker_url)
    enqueue_shards(settings, engine_key, ((job_id, index) for index in range(num_shards)), priority, prefix)


def priority_lists(queue: str) -> list[str]:
    """The Redis lists of one queue, one per priority step, highest priority first."""
    return [f"{queue}{_KOMBU_SEP}{step}" if step else queue for step in PRIORITY_STEPS]


def backlog(settings: Settings, queue: str) -> int:
    """Messages waiting in a queue, every priority (not those delivered and unacknowledged)."""
    client = _client(settings)
    try:
        with client.pipeline() as pipe:
            for name in priority_lists(queue):
                pipe.llen(name)
            return sum(int(n) for n in pipe.execute())
    finally:
        client.close()


# Which engine keys live workers serve: each worker's main process keeps its node name in
# one sorted set per key, scored with the time it last said so (workers.lifecycle, every
# PRESENCE_EVERY_S); a worker silent for PRESENCE_TTL_S counts as gone.
PRESENCE_EVERY_S = 10.0
PRESENCE_TTL_S = 35.0
_PRESENCE_SUFFIX = ":workers"   # a key's set is named after its queue: `<queue>.<key>:workers`


def _presence_key(settings: Settings, engine_key: str) -> str:
    return settings.queue_for(engine_key) + _PRESENCE_SUFFIX


def announce(settings: Settings, engine_keys: Iterable[str], node: str, *, gone: bool = False) -> None:
    """Say that worker `node` serves engine_keys (now), or with gone=True that it stopped."""
    client = _client(settings)
    try:
        with client.pipeline() as pipe:
            for key in engine_keys:
                name = _presence_key(settings, key)
                if gone:
                    pipe.zrem(name, node)
                else:
                    pipe.zadd(name, {node: time.time()})
                    pipe.expire(name, int(PRESENCE_TTL_S * 4))
            pipe.execute()
    finally:
        client.close()


def live_workers(settings: Settings, engine_key: str) -> list[str]:
    """The nodes of the live workers that serve engine_key."""
    client = _client(settings)
    try:
        nodes = client.zrangebyscore(_presence_key(settings, engine_key), time.time() - PRESENCE_TTL_S, "+inf")
        return sorted(n.decode() for n in nodes)
    finally:
        client.close()


def served_engine_keys(settings: Settings) -> list[str]:
    """The engine keys that some live worker of this PIPELINE_QUEUE serves (its presence
    sets, found by name: `<queue>.<key>:workers`)."""
    prefix, suffix = settings.queue_for(""), _PRESENCE_SUFFIX   # _presence_key's name around the key
    client = _client(settings)
    try:
        keys = set()
        for name in client.scan_iter(match=re.sub(r"([*?\[\]\\])", r"\\\1", prefix) + "*" + suffix):
            name = name.decode()
            if client.zcount(name, time.time() - PRESENCE_TTL_S, "+inf"):
                keys.add(name[len(prefix):-len(suffix)])
        return sorted(keys)
    finally:
        client.close()


def _client(settings: Settings) -> redis.Redis:
    return redis.Redis.from_url(settings.broker_url, socket_connect_timeout=5, socket_timeout=5)
