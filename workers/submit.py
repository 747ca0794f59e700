"""The one submit and cancel path that `pipeline submit` / `retry` and `pipeline serve` share.

submit(): the broker is checked before anything exists, the job is made (a
jobs.submission function: one pass that validates and shards the file, the capacity
check, the ledger row), the shards whose every request has a stored answer are committed
from those (jobs.reuse.stored_answers.answer_at_submit), then the rest are sent on its queue; a job
whose shards cannot be sent is failed at once, since it could never run. The errors
are typed, and each caller renders them its own way (an exit code, an HTTP status):
before anything is created, spec.InvalidInput, submission.OverCapacity,
submission.EndpointMismatch, broker.BrokerUnavailable; after, EnqueueFailed.
cancel(): request it, and finish the job at once when none of its shards is running.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from sqlalchemy.orm import Session, sessionmaker

from jobs import ledger
from jobs.ledger import JobStatus
from jobs.settings import Settings
from jobs.several_models import by_engine_key
from workers import broker

log = logging.getLogger(__name__)


class EnqueueFailed(RuntimeError):
    """The job was made but its shards could not be sent: it has been failed."""

    def __init__(self, job_id: str, cause: Exception):
        self.job_id, self.cause = job_id, cause
        super().__init__(f"job {job_id} failed: enqueueing its shards failed: {cause}")


class NotCancellable(ValueError):
    """The job has ended otherwise (completed, failed, expired): there is nothing to cancel."""

    def __init__(self, job_id: str, status: str):
        self.job_id, self.status = job_id, status
        super().__init__(f"job {job_id} is already {status}; it cannot be cancelled")


def submit(settings: Settings, Session: sessionmaker[Session], create: Callable[[], tuple[str, list[int]]],
           ) -> ledger.Job:
    """Make a job with `create()` (returns its id and shard sizes) and queue its shards."""
    broker.check_broker(settings.broker_url)   # no job may wait for a broker that is down
    job_id, sizes = create()
    with Session() as s:
        job = ledger.get_job(s, job_id)
    left = _answer_from_earlier_jobs(Session, settings, job, len(sizes))
    try:
        for key, indexes in _by_engine(Session, job, left).items():   # a several-model job: each model's queue
            broker.enqueue_shards(settings, key, ((job_id, index) for index in indexes), job.priority,
                                  prefix=job.queue)
    except Exception as e:
        from jobs.results.finalize import abandon_job   # results and Parquet: only on this path (pyarrow: 0.5 s, 40 MB)
        abandon_job(Session, settings.data_dir, job_id, f"enqueueing the shards failed: {e}")
        raise EnqueueFailed(job_id, e) from None
    if len(left) < len(sizes):   # answered (in part) at submit: read back what that changed
        with Session() as s:
            job = ledger.get_job(s, job_id)
    return job


def _by_engine(Session, job: ledger.Job, indexes: list[int]) -> dict[str, list[int]]:
    """The shards to send, by the engine key of the queue each goes to (a one-model job: all the job's)."""
    if job.models is None:
        return {job.engine_key: indexes}
    with Session() as s:
        return by_engine_key(job, ledger.get_shards(s, job.id), indexes)


def _answer_from_earlier_jobs(Session, settings: Settings, job: ledger.Job, num_shards: int) -> list[int]:
    """The shards left to send once those answered whole from stored answers are committed;
    every shard if that lookup fails (a worker then reuses what it can: nothing is lost)."""
    from jobs.reuse.stored_answers import answer_at_submit

    try:
        return answer_at_submit(Session, settings.data_dir, job)
    except Exception:
        log.warning("answering job %s from earlier jobs at submit failed; its workers reuse what they can",
                    job.id, exc_info=True)
        return list(range(num_shards))


def cancel(Session: sessionmaker[Session], root, job: ledger.Job) -> ledger.Job:
    """Cancel a job: queued shards are dropped, running ones stop at their next step, what
    finished is kept. Cancelling a cancelled (or cancelling) job again is no error."""
    with Session() as s:
        if not ledger.request_cancel(s, job.id) and job.status not in (JobStatus.CANCELLING, JobStatus.CANCELLED):
            raise NotCancellable(job.id, job.status)
    from jobs.results.finalize import finalize_job
    finalize_job(Session, root, job.id)   # at once when no shard is running
    with Session() as s:
        return ledger.get_job(s, job.id)
