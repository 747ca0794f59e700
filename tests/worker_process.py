"""A real `pipeline worker` subprocess for tests that need one, and its Redis queue."""
from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys

import redis

BROKER_URL = "redis://127.0.0.1:6379/0"


@contextlib.contextmanager
def worker(env, log_path):
    """A `pipeline worker` subprocess, always stopped afterwards (warm, then forced)."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "worker", "--loglevel", "info"],
                                env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def drop_queue(queue: str, broker_url: str = BROKER_URL) -> None:
    """The queue, its bindings, and any message of it still held as unacknowledged."""
    with contextlib.suppress(redis.RedisError):
        client = redis.Redis.from_url(broker_url, socket_connect_timeout=2)
        client.delete(queue, f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}")
        for tag, raw in client.hscan_iter("unacked"):
            with contextlib.suppress(ValueError, TypeError):
                if json.loads(raw)[2] == queue:
                    client.hdel("unacked", tag)
                    client.zrem("unacked_index", tag)
        client.close()
