"""Shard leases: claim with an attempt number (the fencing token), renew, release, commit, fail."""
from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

from sqlalchemy import and_, or_, select, update
from sqlalchemy.orm import Session

from jobs.atomic_files import replace_durably
from jobs.ledger.answers import add_answers
from jobs.ledger.conditional import commit_if_won, execute, held
from jobs.ledger.models import Job, JobStatus, Shard, ShardStatus, utcnow
from jobs.ledger.usage import USAGE_COLUMNS
from jobs.results.result_row import SHARD_TOTALS


def claim_shard(s: Session, job_id: str, index: int, worker: str, lease_s: float, max_attempts: int) -> int | None:
    """Lease a queued shard (or one whose lease expired); return its new attempt, else None.

    The attempt is the fencing token to pass to renew/release/commit. Fails while the job
    is not queued/in_progress (e.g. cancelling) or when max_attempts are used up.
    Also moves the job queued → in_progress the first time.
    """
    now = utcnow()
    job_live = (select(Job.id)
                .where(Job.id == job_id, Job.status.in_(JobStatus.live()))
                .exists())
    stmt = (update(Shard)
            .where(Shard.job_id == job_id, Shard.index == index, job_live,
                   Shard.attempt - Shard.releases < max_attempts,
                   or_(Shard.status == ShardStatus.QUEUED,
                       and_(Shard.status == ShardStatus.RUNNING, Shard.lease_expires_at < now)))
            .values(status=ShardStatus.RUNNING, attempt=Shard.attempt + 1, worker=worker,
                    lease_expires_at=now + timedelta(seconds=lease_s), heartbeat_at=now,
                    started_at=now, finished_at=None, error=None,
                    **dict.fromkeys(USAGE_COLUMNS))   # an earlier attempt's charge (ledger.usage) is not this one's
            .returning(Shard.attempt))
    attempt = s.execute(stmt, execution_options={"synchronize_session": False}).scalar()
    if attempt is None:
        s.rollback()
        return None
    execute(s, update(Job)
             .where(Job.id == job_id, Job.status == JobStatus.QUEUED)
             .values(status=JobStatus.IN_PROGRESS, started_at=now))
    s.commit()
    return attempt


def renew_lease(s: Session, job_id: str, index: int, attempt: int, lease_s: float) -> bool:
    """Extend the lease; False means this worker lost the shard and must stop."""
    now = utcnow()
    stmt = (update(Shard)
            .where(held(job_id, index, attempt))
            .values(lease_expires_at=now + timedelta(seconds=lease_s), heartbeat_at=now))
    return commit_if_won(s, stmt)


def release_shard(s: Session, job_id: str, index: int, attempt: int) -> bool:
    """Graceful shutdown: running → queued without using up an attempt (see module doc)."""
    stmt = (update(Shard)
            .where(held(job_id, index, attempt))
            .values(status=ShardStatus.QUEUED, releases=Shard.releases + 1, worker=None,
                    lease_expires_at=utcnow()))
    return commit_if_won(s, stmt)


def commit_shard(
    s: Session, job_id: str, index: int, attempt: int, *, totals: dict[str, int], tmp_path: str | os.PathLike,
    final_path: str | os.PathLike, status: str = ShardStatus.COMPLETED, answers: list[tuple[str, str]] = (),
    usage: dict | None = None,
) -> bool:
    """Publish an attempt's results: fenced ledger update and file rename in one transaction.

    status is "completed", "cancelled" (a partial shard of a cancelled job) or "failed"
    (error rows of an exhausted shard). totals (jobs.results.result_row.shard_totals: the
    SHARD_TOTALS of its rows) are set on the shard and added to the job; usage, what the attempt
    was charged (the USAGE_COLUMNS, ledger.usage), is set on the shard in the same fenced update;
    answers, (request key, request id) of its reusable successful requests, are indexed
    (ledger.answers) in the same transaction. A stale attempt never commits: it gets False and
    its tmp file is deleted. If the database commit fails after the rename, the shard
    stays running and a later attempt overwrites the file, so results stay consistent.
    """
    if status not in ShardStatus.terminal():
        raise ValueError(f"cannot commit a shard as {status!r}")
    unknown = set(totals) - set(SHARD_TOTALS)
    if unknown:
        raise ValueError(f"unknown shard totals: {sorted(unknown)}")
    if usage is not None and set(usage) != set(USAGE_COLUMNS):
        raise ValueError(f"a shard's usage has {sorted(usage)}, not {sorted(USAGE_COLUMNS)}")
    counts = dict(totals)
    won = execute(s, update(Shard)
                   .where(held(job_id, index, attempt))
                   .values(status=status, finished_at=utcnow(), lease_expires_at=None, **counts, **(usage or {}))
                   ).rowcount == 1
    if not won:
        s.rollback()
        Path(tmp_path).unlink(missing_ok=True)
        return False
    try:
        # Running totals on the job row, so progress needs no aggregation.
        execute(s, update(Job).where(Job.id == job_id).values(
            **{k: getattr(Job, k) + v for k, v in counts.items()}))
        add_answers(s, job_id, index, answers)
        replace_durably(tmp_path, final_path)
    except BaseException:
        s.rollback()
        raise
    s.commit()
    return True


def note_shard_error(s: Session, job_id: str, index: int, attempt: int, error: str) -> bool:
    """Record why an attempt failed, on its shard, while that attempt still holds it: the
    reaper that later gives the shard up quotes it (claim_shard clears it for the next)."""
    return commit_if_won(s, update(Shard).where(held(job_id, index, attempt)).values(error=error))


def fail_shard(s: Session, job_id: str, index: int, attempt: int | None, error: str) -> bool:
    """Mark an unfinished shard failed; with an attempt, only if that attempt still holds it."""
    cond = (held(job_id, index, attempt) if attempt is not None else
            and_(Shard.job_id == job_id, Shard.index == index,
                 Shard.status.in_(ShardStatus.unfinished())))
    stmt = (update(Shard).where(cond)
            .values(status=ShardStatus.FAILED, error=error, finished_at=utcnow(), lease_expires_at=None))
    return commit_if_won(s, stmt)
