"""Running a job's shards in this process, without a broker.

`pipeline run`, `pipeline retry --local` and `pipeline resume` use it: `run_job` inside
`sigterm_as_interrupt` and `cancelled_on_interrupt`. run_job runs every shard nobody
holds (queued, or running under an expired lease: the process that held it died)
through the same run_shard as on a worker, leased and fenced, several in flight at once
sharing the engine's batches, and one attempt each here (a crash becomes the shard's
error rows). A shard that a live process holds is left to it, and taken over once its
lease expires. A new job and an interrupted one take the same path: resuming is running
what is left.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

from sqlalchemy.orm import Session, sessionmaker

from jobs import ledger
from jobs.results.finalize import abandon_job, finalize_job, refinalize_job
from jobs.ledger import JobStatus, ShardStatus
from jobs.several_models import by_engine_key
from workers.admission import AdmissionGate
from workers.engine_cache import EngineCache
from workers.recovery import DEFAULT_FINALIZE_GRACE_S, sweep_tmp
from workers.shard_runner import ShardOutcome, run_shard


class EngineDidNotStart(RuntimeError):
    """The job's engine could not be built; the job was failed."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, taken as Ctrl-C is: the job is cancelled at the next step, what finished is kept."""


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Inside, SIGTERM raises Terminated in the main thread, as Ctrl-C raises KeyboardInterrupt."""
    def terminate(signum, frame):
        raise Terminated()

    try:
        previous = signal.signal(signal.SIGTERM, terminate)
    except ValueError:  # not the main thread: signals cannot be handled here
        previous = None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def cancelled_on_interrupt(Session: sessionmaker[Session], root, job_id: str) -> Iterator[None]:
    """Ctrl-C (or SIGTERM, as Terminated) inside cancels the job and ends it before the
    interrupt goes on."""
    try:
        yield
    except KeyboardInterrupt:
        with Session() as s:
            ledger.request_cancel(s, job_id)
        abandon_job(Session, root, job_id, "interrupted")
        raise


def start_engine(Session: sessionmaker[Session], root, job_id: str, engine_options: dict,
                 tokenizer_processes: int | str = 0) -> EngineCache:
    """Build the job's engine; a model that cannot load fails the job (EngineDidNotStart), not each shard."""
    engines = EngineCache(tokenizer_processes=tokenizer_processes)
    try:
        with engines.use(engine_options):
            pass   # built now; the cache keeps it for the shards
    except Exception as e:
        abandon_job(Session, root, job_id, f"the engine could not start: {e}")
        raise EngineDidNotStart(f"the engine could not start: {e}") from None
    return engines


def run_job(Session: sessionmaker[Session], root, job_id: str, engine_options: dict, *, shards_in_flight: int,
            lease_s: float, on_result: Callable[[dict], None] | None = None,
            on_wait: Callable[[ledger.Job, list[ledger.Shard]], None] | None = None,
            poll_s: float = 1.0, tokenizer_processes: int | str = 0) -> ledger.Job:
    """Run job_id here until it ends; returns the ended job.

    Each pass runs the shards nobody holds (building the engine on the first that needs
    it). While only shards that live processes hold are left, it calls on_wait(job, those
    shards) and looks again every poll_s. A job nobody will end is ended here: all its
    shards ended but its finalizer died, or it is being cancelled and nobody holds a shard.
    tokenizer_processes: the engine loop's (PIPELINE_TOKENIZER_PROCESSES).
    """
    engines: EngineCache | None = None
    try:
        while True:
            with Session() as s:
                job = ledger.get_job(s, job_id)
                shards = ledger.get_shards(s, job_id)
            if job.finished_at is not None:
                sweep_tmp(Session, root, job_id)  # a result file a killed attempt left behind
                return job
            now = ledger.utcnow()
            free = [sh.index for sh in shards if _nobody_holds(sh, now)]
            if free and job.status in JobStatus.live():
                # a several-model job: the engine its first free shard needs (not a model it may not use)
                first = next(sh for sh in shards if sh.index == free[0]).engine_options
                engines = engines or start_engine(Session, root, job_id, first or engine_options, tokenizer_processes)
                outcomes = []
                for indexes in by_engine_key(job, shards, free).values():   # several models: one, then the next
                    outcomes += run_shards(Session, root, job_id, indexes, engines, shards_in_flight=shards_in_flight,
                                           lease_s=lease_s, on_result=on_result)
                if any(o not in (ShardOutcome.BUSY, ShardOutcome.SKIPPED) for o in outcomes):
                    continue  # progress: look again at once
            else:
                held = [sh for sh in shards if sh.status in ShardStatus.unfinished() and sh.index not in free]
                if not held and _end_unheld(Session, root, job, free):
                    continue
                if on_wait is not None:
                    on_wait(job, held)
            time.sleep(poll_s)
    finally:
        if engines is not None:
            engines.close()   # the model and KV cache go now, not when the process ends


def run_shards(Session: sessionmaker[Session], root, job_id: str, indexes: list[int], engines: EngineCache, *,
               shards_in_flight: int, lease_s: float, on_result: Callable[[dict], None] | None = None,
               ) -> list[ShardOutcome]:
    """Run the shards `indexes` of job_id here, up to `shards_in_flight` at a time (each
    starting once the engine's batch has room for it, as on a worker); their outcomes.

    Each gets one attempt more than it has used (a shard whose process died gets another),
    and that attempt is its last: an exception becomes the shard's error rows.
    Interrupted (Ctrl-C), it cancels the job in the ledger so that the running shards stop
    at their next step and commit what finished, waits for them, and re-raises.
    """
    worker = f"{socket.gethostname()}:{os.getpid()}"
    interrupted = threading.Event()
    gate = AdmissionGate(engines)

    def run(index: int) -> ShardOutcome:
        with gate.room(stop=interrupted.is_set, shard=(job_id, index)):
            with Session() as s:
                shard = ledger.get_shard(s, job_id, index)
            return run_shard(Session, root, job_id, index, engine_provider=engines.use, worker_name=worker,
                             lease_s=lease_s, max_attempts=shard.attempt - shard.releases + 1,
                             on_result=on_result)

    pool = ThreadPoolExecutor(max_workers=shards_in_flight, thread_name_prefix="shard")
    try:
        futures = [pool.submit(run, index) for index in indexes]
        outcomes = [future.result() for future in futures]
    except BaseException:
        interrupted.set()
        with Session() as s:
            ledger.request_cancel(s, job_id)
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown()
    return outcomes


def _nobody_holds(shard: ledger.Shard, now) -> bool:
    """Queued, or running under a lease that expired (its holder died, or lost it)."""
    if shard.status == ShardStatus.QUEUED:
        return True
    return shard.status == ShardStatus.RUNNING and (shard.lease_expires_at is None or shard.lease_expires_at < now)


def _end_unheld(Session, root, job: ledger.Job, free: list[int]) -> bool:
    """End a job whose shards nobody holds and that nobody else will end; True once it has."""
    if job.finalizing_at is not None:  # a finalizer claimed it: taken over only once it is stale
        return refinalize_job(Session, root, job.id, DEFAULT_FINALIZE_GRACE_S)
    if job.status == JobStatus.CANCELLING and free:  # no one may claim them: end them as the cancel would
        return abandon_job(Session, root, job.id, "the process cancelling the job stopped before its shards did")
    if job.status == JobStatus.EXPIRING and free:  # its window passed: queued shards never run
        with Session() as s:
            ledger.cancel_orphaned_shards(s)
    return finalize_job(Session, root, job.id)
