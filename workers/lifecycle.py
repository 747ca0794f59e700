"""The worker's lifecycle: Celery signal handlers (the app's `include` connects them).

None of them builds an engine:
* worker_ready (main process): start the recovery thread;
* worker_shutting_down (main process, on SIGTERM/SIGINT — a warm shutdown): every
  running shard stops at its next engine step and is released (its attempt given back)
  and re-enqueued, so the warm shutdown ends within a step instead of after the shard.
  With a prefork pool the children are told with SIGUSR2; a child killed outright (e.g.
  the whole process group got SIGTERM) loses its shard to the reaper instead, which
  re-enqueues it once its lease expires — delayed, never lost;
* worker_process_init (prefork child): drop the parent's ledger connections, and take
  SIGUSR2 as the shutdown request.

And the observability (workers.metrics, workers.logs): celeryd_init names the process's
series and log records after the worker's node; worker_init (main process) serves
/metrics on PIPELINE_METRICS_PORT; after_setup_logger switches Celery's handlers to JSON
under PIPELINE_LOG_FORMAT=json; task_prerun / task_postrun bind a shard task's ids to its
log records; worker_process_shutdown (prefork child) takes its live gauges away.
"""
from __future__ import annotations

import logging
import os
import signal

from celery import signals

from workers import broker, logs, metrics, recovery
from workers.app import settings
from workers.shard_runner import request_shutdown

log = logging.getLogger(__name__)


@signals.worker_ready.connect
def _start_recovery(sender=None, **_):
    recovery.start_thread(settings(),
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


# ---- metrics and logs ------------------------------------------------------------------------

@signals.celeryd_init.connect
def _name_series_and_records(sender=None, **_):
    if sender:
        metrics.set_worker(sender)
        logs.set_node(sender)


@signals.worker_init.connect
def _serve_metrics(sender=None, **_):
    port = settings().metrics_port
    if not port:
        return
    from celery.concurrency import get_implementation
    from celery.concurrency.prefork import TaskPool as Prefork
    prefork = issubclass(get_implementation(sender.pool_cls), Prefork)
    if prefork and not metrics.is_multiprocess():
        # The children's values would never reach the parent's endpoint.
        log.error("metrics: a prefork worker needs PROMETHEUS_MULTIPROC_DIR (an empty directory) set before "
                  "it starts (`pipeline worker --concurrency N` sets it); not serving metrics")
        return
    metrics.serve(port)   # a no-op when `pipeline worker` already serves them


@signals.after_setup_logger.connect
@signals.after_setup_task_logger.connect
def _format_logs(logger=None, **_):
    if settings().log_format == "json" and logger is not None:
        logs.use_json(logger)
        logs.celery_notices_as_json()


_shard_log_tokens: dict[str, object] = {}   # task id -> its logs.bind_shard token


@signals.task_prerun.connect
def _bind_shard_logs(task_id=None, task=None, args=None, **_):
    if getattr(task, "name", None) == broker.RUN_SHARD and args and len(args) == 2:
        worker = f"{task.request.hostname}:{os.getpid()}"
        _shard_log_tokens[task_id] = logs.bind_shard(args[0], args[1], worker=worker, task_id=task_id)


@signals.task_postrun.connect
def _unbind_shard_logs(task_id=None, **_):
    token = _shard_log_tokens.pop(task_id, None)
    if token is not None:
        logs.unbind(token)


@signals.worker_process_shutdown.connect
def _drop_live_gauges(pid=None, **_):
    metrics.mark_process_dead(pid or os.getpid())
