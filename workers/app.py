"""The Celery app. Tasks carry ids only (never prompts), as JSON; pickle is refused.

Settings come from the environment, shared with the CLI and docker-compose:
PIPELINE_BROKER_URL (default redis://127.0.0.1:6379/0), PIPELINE_QUEUE (default "pipeline"),
PIPELINE_VISIBILITY_TIMEOUT (seconds, default 3600).

The visibility timeout is how long Redis waits for a delivered message's ack before it
hands the message to another worker. A shard running longer is delivered again while
its first copy runs; that copy finds the shard leased and is dropped ("busy"), so the
timeout only costs duplicate deliveries, never duplicate results. A worker that dies is
covered by the lease and the reaper (workers.recovery), not by this timeout.
"""
from __future__ import annotations

import os

from celery import Celery

DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/0"
VISIBILITY_TIMEOUT_S = int(os.environ.get("PIPELINE_VISIBILITY_TIMEOUT") or 3600)


def broker_url() -> str:
    return os.environ.get("PIPELINE_BROKER_URL") or DEFAULT_BROKER_URL


app = Celery("pipeline", broker=broker_url(), include=["workers.tasks"])
app.conf.update(
    task_default_queue=os.environ.get("PIPELINE_QUEUE") or "pipeline",
    task_ignore_result=True,  # progress and outcomes live in the ledger
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    # A shard's message is acked only once it ran; a dead worker's shard is redelivered.
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,  # shards are long: never hoard them
    broker_transport_options={
        "visibility_timeout": VISIBILITY_TIMEOUT_S,
        # kombu scans for overdue messages every interval * throttle seconds (100 s by
        # default): keep that well under a short visibility timeout.
        "unacked_restore_interval": max(1, min(10, VISIBILITY_TIMEOUT_S // 2)),
        "unacked_restore_throttle": 1 if VISIBILITY_TIMEOUT_S < 600 else 10,
    },
    broker_connection_retry_on_startup=True,
)
