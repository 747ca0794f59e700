"""The Celery app. Tasks carry ids only (never prompts), as JSON; pickle is refused.

Its settings (jobs.settings.Settings) are read from the environment when this module is
imported (`celery -A workers.app`, producers), or given by `pipeline worker` through
`configure`; tasks and the worker's signal handlers read them from `app.conf.pipeline_settings`.
A worker consumes only the queues of the engines it serves (one per engine key,
Settings.queue_for), so a job's shards reach only workers holding its model.

The visibility timeout is how long Redis waits for a delivered message's ack before it
hands the message to another worker. A shard running longer is delivered again while
its first copy runs; that copy finds the shard leased and is dropped ("busy"), so the
timeout only costs duplicate deliveries, never duplicate results. A worker that dies is
covered by the lease and the reaper (workers.recovery), not by this timeout.
"""
from __future__ import annotations

from celery import Celery, signals
from kombu import Queue

from jobs.scheduling import PRIORITY_STEPS
from jobs.settings import Settings
from pipeline.engine_key import engine_key

# workers.lifecycle holds the signal handlers: importing it connects them.
app = Celery("pipeline", include=["workers.tasks", "workers.lifecycle"])


@signals.import_modules.connect
def _worker_allocators(sender=None, **_):
    """A worker's process-wide memory settings, made as it starts, before its task modules
    import numpy and pyarrow (they start threads, and pyarrow picks its allocator when it is
    imported): one malloc arena, so the engine's thread keeps its memory (pipeline/host_memory.py),
    and results written through the system's malloc (jobs/results/arrow_allocator.py). `pipeline worker` has
    made them already (cli.main, before any import); this is for `celery -A
    workers.app worker`. Nothing is set by importing this module (producers import it)."""
    from jobs.results.arrow_allocator import use_system_allocator
    from pipeline.host_memory import use_one_malloc_arena

    use_one_malloc_arena()
    use_system_allocator()


app.conf.update(
    task_ignore_result=True,  # progress and outcomes live in the ledger
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    # A shard's message is acked only once it ran; a dead worker's shard is redelivered.
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,  # shards are long: never hoard them
    broker_connection_retry_on_startup=True,
    # Task events (sent, received, started, succeeded, ...) for Flower and `celery events`:
    # a few small messages per shard.
    worker_send_task_events=True,
    task_send_sent_event=True,
)


def served_queues(settings: Settings) -> list[str]:
    """The queues a worker with these settings consumes: one per engine key it serves."""
    return [settings.queue_for(engine_key(options)) for options in settings.served_engine_options()]


def configure(settings: Settings) -> None:
    """Point the app at the settings' broker and at the queues of the engines it serves
    (PIPELINE_WORKER_ENGINES), and keep the settings for the tasks."""
    timeout_s = settings.visibility_timeout_s
    queues = served_queues(settings)
    app.conf.update(
        pipeline_settings=settings,
        broker_url=settings.broker_url,
        task_queues=[Queue(name, routing_key=name) for name in queues],
        task_default_queue=queues[0],
        broker_transport_options={
            "visibility_timeout": timeout_s,
            # A job's priority is its messages' priority (workers.broker): one list per step.
            "priority_steps": PRIORITY_STEPS,
            # kombu scans for overdue messages every interval * throttle seconds (100 s by
            # default): keep that well under a short visibility timeout.
            "unacked_restore_interval": max(1, min(10, timeout_s // 2)),
            "unacked_restore_throttle": 1 if timeout_s < 600 else 10,
        },
    )


def settings() -> Settings:
    """The settings the app was configured with."""
    return app.conf.pipeline_settings


configure(Settings.from_env())
