"""Running a created job's shards in this process, one after the other, without a broker.

`pipeline run` and `pipeline retry --local` use it: `start_engine`, then `run_shards`,
both inside `cancelled_on_interrupt`. The shards go through the same run_shard as on a
worker, with one attempt each (a crash becomes the shard's error rows).
"""
from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Iterator

from sqlalchemy.orm import Session, sessionmaker

from jobs import ledger
from jobs.finalize import abandon_job
from workers.engine_holder import EngineHolder
from workers.shard_runner import run_shard


class EngineDidNotStart(RuntimeError):
    """The job's engine could not be built; the job was failed."""


@contextlib.contextmanager
def cancelled_on_interrupt(Session: sessionmaker[Session], root, job_id: str) -> Iterator[None]:
    """Ctrl-C inside cancels the job and ends it before the KeyboardInterrupt goes on."""
    try:
        yield
    except KeyboardInterrupt:
        with Session() as s:
            ledger.request_cancel(s, job_id)
        abandon_job(Session, root, job_id, "interrupted")
        raise


def start_engine(Session: sessionmaker[Session], root, job_id: str, engine_options: dict) -> EngineHolder:
    """Build the job's engine; a model that cannot load fails the job (EngineDidNotStart), not each shard."""
    engines = EngineHolder()
    try:
        engines.get(engine_options)
    except Exception as e:
        abandon_job(Session, root, job_id, f"the engine could not start: {e}")
        raise EngineDidNotStart(f"the engine could not start: {e}") from None
    return engines


def run_shards(Session: sessionmaker[Session], root, job_id: str, num_shards: int, engines: EngineHolder, *,
               on_result: Callable[[dict], None] | None = None) -> ledger.Job:
    """Run every shard of job_id here; returns the ended job."""
    worker = f"{socket.gethostname()}:{os.getpid()}"
    for index in range(num_shards):
        run_shard(Session, root, job_id, index, engine_provider=engines.get, worker_name=worker,
                  max_attempts=1, on_result=on_result)
    with Session() as s:
        return ledger.get_job(s, job_id)
