"""A real `pipeline worker` subprocess for tests that need one, and its Redis queue."""
from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
from pathlib import Path

import redis

BROKER_URL = "redis://127.0.0.1:6379/0"
REPO = Path(__file__).resolve().parent.parent   # `-m tests.hold` is found from here


@contextlib.contextmanager
def worker(env, log_path, *args, held: bool = False):
    """A `pipeline worker ARGS` subprocess (e.g. --model DIR: the engine it serves), always
    stopped afterwards (warm, then forced). held: under tests/hold.py's hold (its "held-"
    requests wait mid-generation until their stream stops, or TEST_HOLD_DIR releases them)."""
    module = ["tests.hold", "cli"] if held else ["cli"]   # `python -m tests.hold cli worker ...`
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", *module, "worker", "--loglevel", "info", *map(str, args)],
                                env=env, cwd=REPO if held else None, stdout=log, stderr=subprocess.STDOUT)
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
    """A PIPELINE_QUEUE's queues (one per engine key, `<queue>.<key>`), their bindings and
    worker presence sets, and any message of them still held as unacknowledged."""
    with contextlib.suppress(redis.RedisError):
        client = redis.Redis.from_url(broker_url, socket_connect_timeout=2)
        names = [queue, *(k.decode() for k in client.scan_iter(match=f"{queue}.*"))]
        for name in names:
            client.delete(name, f"_kombu.binding.{name}", f"_kombu.binding_permanent.{name}")
        for tag, raw in client.hscan_iter("unacked"):
            with contextlib.suppress(ValueError, TypeError):
                if json.loads(raw)[2] in names:
                    client.hdel("unacked", tag)
                    client.zrem("unacked_index", tag)
        client.close()


def queued_messages(queue: str, broker_url: str = BROKER_URL) -> int:
    """Messages waiting in a PIPELINE_QUEUE's engine queues."""
    client = redis.Redis.from_url(broker_url, socket_connect_timeout=2)
    try:
        return sum(client.llen(k) for k in client.scan_iter(match=f"{queue}.*") if client.type(k) == b"list")
    finally:
        client.close()
