"""Read-only counts for monitoring (`pipeline metrics`): jobs by status, and where each
job that has not ended stands. Plain reads, no locks: a scrape sees a recent snapshot."""
from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from jobs.ledger.models import Job, JobStatus, Shard


def jobs_by_status(s: Session) -> dict[str, int]:
    """Every job status (0 for none) and how many jobs are in it."""
    counts = dict.fromkeys((str(status) for status in JobStatus), 0)
    counts.update((status, n) for status, n in s.execute(select(Job.status, func.count()).group_by(Job.status)))
    s.commit()
    return counts


def live_jobs(s: Session) -> list[Job]:
    """The jobs that have not ended, oldest first (their running totals are kept per shard commit)."""
    jobs = list(s.scalars(select(Job).where(Job.status.not_in(JobStatus.terminal()))
                          .order_by(Job.created_at, Job.id).execution_options(populate_existing=True)))
    s.commit()
    return jobs


def live_shards_by_status(s: Session) -> dict[tuple[str, str], int]:
    """(job id, shard status) -> shards, for the jobs that have not ended."""
    rows = s.execute(select(Shard.job_id, Shard.status, func.count())
                     .join(Job, Job.id == Shard.job_id)
                     .where(Job.status.not_in(JobStatus.terminal()))
                     .group_by(Shard.job_id, Shard.status)).all()
    s.commit()
    return {(job_id, status): n for job_id, status, n in rows}


def live_engine_keys(s: Session) -> list[str]:
    """The engine keys of the jobs that have not ended (the queues their shards wait in)."""
    keys = s.scalars(select(Job.engine_key).distinct()
                     .where(Job.status.not_in(JobStatus.terminal()), Job.engine_key.is_not(None))).all()
    s.commit()
    return sorted(keys)
