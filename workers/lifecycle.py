"""The worker's lifecycle: Celery signal handlers (the app's `include` connects them).

Loading the engine: worker_init (main process) loads it in a thread when the shards run
in this process (solo, threads); worker_process_init does so in each prefork child (never
in the parent: CUDA must not be initialised before a fork). Besides that:
* worker_ready (main process): start the recovery thread, and the presence thread that
  says in Redis which engine keys this worker serves (workers.broker.announce);
* worker_shutting_down (main process, on SIGTERM/SIGINT — a warm shutdown): every
  running shard stops at its next engine step and is released (its attempt given back)
  and re-enqueued, so the warm shutdown ends within a step instead of after the shard.
  With a prefork pool the children are told with SIGUSR2; a child killed outright (e.g.
  the whole process group got SIGTERM) loses its shard to the reaper instead, which
  re-enqueues it once its lease expires — delayed, never lost;
* worker_shutdown (main process, once the shards have stopped): close the engine (waiting
  for one still loading), so that the process exits 0 and never with SIGABRT;
* worker_process_init (prefork child): drop the parent's ledger connections, take
  SIGUSR2 as the shutdown request, and load the engine.

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
import threading

from celery import signals

from workers import broker, logs, metrics, recovery
from workers.app import settings
from workers.shard_runner import request_shutdown

log = logging.getLogger(__name__)


_presence: threading.Event | None = None   # set to stop announcing the engines served
_node = "worker"   # the Celery node name (set at worker_ready)


@signals.worker_init.connect
def _preload_engine(sender=None, **_):
    if not _is_prefork(sender):   # the engine lives in this process (solo, threads): load it now
        _start_preload()


def _is_prefork(worker) -> bool:
    """Whether the worker's tasks run in prefork children (worker: Celery's WorkController)."""
    from celery.concurrency import get_implementation
    from celery.concurrency.prefork import TaskPool as Prefork
    return issubclass(get_implementation(worker.pool_cls), Prefork)


def _start_preload() -> None:
    from workers.tasks import preload_engine
    threading.Thread(target=preload_engine, name="engine-preload", daemon=True).start()


@signals.worker_ready.connect
def _start_recovery(sender=None, **_):
    global _node
    node = _node = getattr(sender, 'hostname', None) or 'worker'
    recovery.start_thread(settings(), worker_name=f"reaper@{node}:{os.getpid()}")
    for options, key in zip(settings().served_engine_options(), _served_keys()):
        log.info("serving engine %s (model %s) from queue %s", key, options.get("model") or "bundled",
                 settings().queue_for(key))
    _start_presence(node)


def _start_presence(node: str) -> None:
    """Say in Redis which engine keys this worker serves, every PRESENCE_EVERY_S, so that
    `pipeline submit` and `status` can tell a job that no live worker will take."""
    global _presence
    _presence = stop = threading.Event()

    def run() -> None:
        while True:
            _announce(node)
            if stop.wait(broker.PRESENCE_EVERY_S):
                return

    threading.Thread(target=run, name="engine-presence", daemon=True).start()


def _announce(node: str, gone: bool = False) -> None:
    try:
        broker.announce(settings(), _served_keys(), node, gone=gone)
    except Exception as e:   # the broker is away: the consumer reconnects, and so do we
        log.warning("announcing the engines served failed: %s", e)


def _served_keys() -> list[str]:
    from pipeline.engine_key import engine_key
    return [engine_key(options) for options in settings().served_engine_options()]


@signals.worker_shutting_down.connect
def _release_running_shards(sig=None, how=None, **_):
    request_shutdown()
    recovery.stop_thread()
    if _presence is not None:   # no new shards for this worker: it is gone for `pipeline submit`
        _presence.set()
        _announce(_node, gone=True)
    from billiard.process import active_children
    for child in active_children():  # prefork: the shards run in the children
        try:
            os.kill(child.pid, signal.SIGUSR2)
        except (ProcessLookupError, TypeError):
            pass


@signals.worker_shutdown.connect
def _close_engine(**_):
    """Free this process's engine, joining its thread, once the warm shutdown has stopped the
    shards: the interpreter must not exit while the engine's thread is inside a torch op (a
    SIGTERM while the engine loads at start-up aborted the process: "terminate called without
    an active exception", pytorch#38228, SIGABRT in 3 of 6 tries). A build in progress is
    waited for, then closed, here where the log can say so (EngineLoop's own exit hook is the
    backstop). (Prefork children end with os._exit: nothing to do.)"""
    from workers.tasks import engines
    cache = engines()
    if cache.building:
        log.info("waiting for the engine being loaded, to close it before exiting")
    cache.close()


@signals.worker_process_init.connect
def _init_child(**_):
    recovery.forget_pool_after_fork()
    signal.signal(signal.SIGUSR2, lambda *_: request_shutdown())
    _start_preload()   # prefork: each child holds its own engine, loaded after the fork


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
    if _is_prefork(sender) and not metrics.is_multiprocess():
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
