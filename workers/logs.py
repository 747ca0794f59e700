"""Worker logs: Celery's text lines, or one JSON object a line (`--log-format json`) whose
records about a shard carry its job_id, shard, attempt and worker.

The ids live in a context variable: the shard task binds job_id, shard, worker and the
Celery task id before it runs (workers.lifecycle, on task_prerun, so Celery's own
"Task ... succeeded" line has them too) and run_shard adds the attempt once it claimed
the shard; a filter on the handlers copies them onto each record made in that thread, or
in a thread started from its context (the lease keeper), and reads them from Celery's
"Task ... received" record. python-json-logger writes the records; every one also names
its worker process as the ledger's `shards.worker` does.
"""
from __future__ import annotations

import contextvars
import logging
import os
import socket
import sys

from pythonjsonlogger.json import JsonFormatter

from workers.broker import RUN_SHARD, SHARD_REPR

_shard: contextvars.ContextVar[dict | None] = contextvars.ContextVar("pipeline_shard", default=None)
_node = socket.gethostname()   # a Celery worker: its node name (set_node)


def set_node(name: str) -> None:
    """The name records give their worker as, with the process id: `name:pid`."""
    global _node
    _node = name


def bind_shard(job_id: str, shard: int, worker: str | None = None, task_id: str | None = None) -> contextvars.Token:
    """Records in this context are about this shard until `unbind(token)`."""
    return _shard.set({"job_id": job_id, "shard": shard, "attempt": None,
                       "worker": worker or f"{_node}:{os.getpid()}", "task_id": task_id})


def unbind(token: contextvars.Token) -> None:
    _shard.reset(token)


def bind_attempt(attempt: int | None) -> None:
    """The attempt that claimed the bound shard (nothing bound: nothing to do)."""
    fields = _shard.get()
    if fields is not None:
        fields["attempt"] = attempt


class ShardFields(logging.Filter):
    """Puts the bound shard's ids on a record, and the worker on every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        fields = _shard.get() or _received_shard(record)
        if fields is not None:
            for key, value in fields.items():
                setattr(record, key, value)
        if getattr(record, "worker", None) is None:
            record.worker = f"{_node}:{record.process}"
        return True


def _received_shard(record: logging.LogRecord) -> dict | None:
    """The shard of Celery's "Task ... received" record, logged by the consumer before any
    task runs: its `data` holds the task's id, name and arguments as broker.shard_repr wrote them."""
    data = getattr(record, "data", None)
    if not isinstance(data, dict) or data.get("name") != RUN_SHARD:
        return None
    match = SHARD_REPR.fullmatch(str(data.get("args")))
    if match is None:
        return None
    return {"job_id": match["job_id"], "shard": int(match["shard"]), "attempt": None, "worker": None,
            "task_id": data.get("id")}


def json_formatter() -> logging.Formatter:
    return JsonFormatter("%(asctime)s %(levelname)s %(name)s %(message)s",
                         rename_fields={"asctime": "time", "levelname": "level", "name": "logger"})


def use_json(logger: logging.Logger) -> None:
    """Make the logger's handlers write JSON lines with the shard fields (Celery's
    after_setup_logger signal hands us its configured loggers)."""
    for handler in logger.handlers:
        handler.setFormatter(json_formatter())
        if not any(isinstance(f, ShardFields) for f in handler.filters):
            handler.addFilter(ShardFields())
    logging.captureWarnings(True)   # warnings go through the handlers too, not as bare lines


def celery_notices_as_json() -> None:
    """Celery writes a few notices ("worker: Warm shutdown (MainProcess)", ...) from its
    signal handlers straight to the terminal with one os.write, bypassing logging (which
    could deadlock there). In JSON mode they become JSON lines too, still one os.write each,
    formatted without taking any handler's lock."""
    import celery.apps.worker as celery_worker

    formatter, fields = json_formatter(), ShardFields()

    def say(msg, f=sys.__stderr__):
        record = logging.LogRecord("celery.apps.worker", logging.WARNING, __file__, 0, str(msg).strip(), None, None)
        fields.filter(record)
        try:
            os.write(f.fileno(), (formatter.format(record) + "\n").encode())
        except (OSError, ValueError, AttributeError):   # a notice never stops a shutdown
            pass

    celery_worker.safe_say = say


def log_to_stderr_as_json(level: int = logging.INFO) -> None:
    """JSON on stderr before Celery sets up its logging (which then replaces this handler)."""
    handler = logging.StreamHandler(sys.stderr)
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(level)
    use_json(root)
