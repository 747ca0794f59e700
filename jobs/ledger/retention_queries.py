"""Retention's ledger steps: the jobs whose results are past their keep, and marking them gone."""
from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from jobs.ledger.models import Job, utcnow
from jobs.ledger.statuses import JobStatus


def results_expire_at(job: Job) -> datetime | None:
    """When the job's results go: its end plus its keep (None: kept for ever, or not ended)."""
    return _expiry(job.finished_at, job.keep_seconds)


def _expiry(finished_at: datetime | None, keep_seconds: int | None) -> datetime | None:
    if keep_seconds is None or finished_at is None:
        return None
    return finished_at + timedelta(seconds=keep_seconds)


def results_due(s: Session, now: datetime | None = None) -> list[str]:
    """The ended jobs with a keep whose results are past it and not deleted yet, oldest end first.
    Every recovery pass asks: only the three columns it needs are read, not whole job rows."""
    now = now or utcnow()
    rows = s.execute(select(Job.id, Job.finished_at, Job.keep_seconds).where(
        Job.status.in_([st.value for st in JobStatus.terminal()]), Job.keep_seconds.is_not(None),
        Job.results_expired_at.is_(None), Job.finished_at.is_not(None)).order_by(Job.finished_at)).all()
    s.commit()
    # The end plus the keep is compared here: the two databases add seconds to a time differently.
    return [job_id for job_id, finished_at, keep_seconds in rows if _expiry(finished_at, keep_seconds) <= now]


def mark_results_expired(s: Session, job_id: str) -> bool:
    """Record that the job's results were deleted; True if this call did (once per job)."""
    won = s.execute(update(Job).where(Job.id == job_id, Job.results_expired_at.is_(None))
                    .values(results_expired_at=utcnow())).rowcount == 1
    s.commit()
    return won
