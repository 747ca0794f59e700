"""Running a created job's shards in this process, without a broker.

`pipeline run` and `pipeline retry --local` use it: `start_engine`, then `run_shards`,
both inside `cancelled_on_interrupt`. The shards go through the same run_shard as on a
worker, with one attempt each (a crash becomes the shard's error rows), and as on a
worker several are in flight at once, sharing the engine's batches.
"""
from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

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
        with engines.use(engine_options):
            pass   # built now; the holder keeps it for the shards
    except Exception as e:
        abandon_job(Session, root, job_id, f"the engine could not start: {e}")
        raise EngineDidNotStart(f"the engine could not start: {e}") from None
    return engines


def run_shards(Session: sessionmaker[Session], root, job_id: str, num_shards: int, engines: EngineHolder, *,
               shards_in_flight: int, on_result: Callable[[dict], None] | None = None) -> ledger.Job:
    """Run every shard of job_id here, up to `shards_in_flight` at a time (each starting
    once the engine's batch has room for it, as on a worker); returns the ended job.

    Interrupted (Ctrl-C), it cancels the job in the ledger so that the running shards stop
    at their next step and commit what finished, waits for them, and re-raises.
    """
    worker = f"{socket.gethostname()}:{os.getpid()}"
    interrupted = threading.Event()

    def run(index: int):
        engines.wait_for_room(stop=interrupted.is_set)
        return run_shard(Session, root, job_id, index, engine_provider=engines.use,
                         worker_name=worker, max_attempts=1, on_result=on_result)

    pool = ThreadPoolExecutor(max_workers=shards_in_flight, thread_name_prefix="shard")
    try:
        futures = [pool.submit(run, index) for index in range(num_shards)]
        for future in futures:
            future.result()
    except BaseException:
        interrupted.set()
        with Session() as s:
            ledger.request_cancel(s, job_id)
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown()
    with Session() as s:
        return ledger.get_job(s, job_id)
