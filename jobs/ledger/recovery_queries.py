"""The queries and conditional updates recovery (workers.recovery) is built from.

Many recovery passes at once each win a given step once.
"""
from __future__ import annotations

from datetime import timedelta
from typing import NamedTuple

from sqlalchemy import func, or_, select, update
from sqlalchemy.orm import Session

from jobs.ledger.conditional import commit_if_won, held
from jobs.ledger.models import Job, JobStatus, Shard, ShardStatus, utcnow


def expired_shards(s: Session, max_attempts: int) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """Reaper: handle running shards whose lease expired.

    Returns (requeued, exhausted). Shards with attempts left are set back to queued
    (each conditionally, so concurrent reapers requeue a shard once) and the caller
    re-enqueues them. Exhausted shards are left running with their dead lease for the
    caller to write error rows (commit_shard status="failed") or fail_shard.
    """
    now = utcnow()
    rows = s.execute(
        select(Shard.job_id, Shard.index, Shard.attempt, Shard.releases)
        .where(Shard.status == ShardStatus.RUNNING, Shard.lease_expires_at < now)
        .order_by(Shard.job_id, Shard.index)
    ).all()
    s.commit()
    requeued, exhausted = [], []
    for job_id, index, attempt, releases in rows:
        if attempt - releases >= max_attempts:
            exhausted.append((job_id, index))
            continue
        stmt = (update(Shard)
                .where(held(job_id, index, attempt), Shard.lease_expires_at < now)
                .values(status=ShardStatus.QUEUED, worker=None))
        if commit_if_won(s, stmt):
            requeued.append((job_id, index))
    return requeued, exhausted


def queued_shards(s: Session, older_than_s: float) -> list[tuple[str, int]]:
    """Reconciler: shards queued for longer than older_than_s (the broker may have lost them).

    A shard counts as queued since its last lease ended, or since its job was created.
    """
    cutoff = utcnow() - timedelta(seconds=older_than_s)
    since = func.coalesce(Shard.lease_expires_at, Job.created_at)
    rows = s.execute(
        select(Shard.job_id, Shard.index).join(Job, Job.id == Shard.job_id)
        .where(Shard.status == ShardStatus.QUEUED, since < cutoff,
               Job.status.in_(JobStatus.live()))
        .order_by(Shard.job_id, Shard.index)
    ).all()
    s.commit()
    return [(job_id, index) for job_id, index in rows]


def take_over_expired(s: Session, job_id: str, index: int, attempt: int, worker: str, lease_s: float) -> bool:
    """Reaper: lease a running shard whose lease expired to `worker`, keeping its attempt.

    For an exhausted shard (no attempts left) whose error rows the reaper commits with
    commit_shard(attempt, status="failed"). The condition on the dead lease makes one
    reaper of many win; a worker that was only slow, not dead, still races on the same
    fencing token in commit_shard, so at most one of them commits.
    """
    now = utcnow()
    stmt = (update(Shard)
            .where(held(job_id, index, attempt), Shard.lease_expires_at < now)
            .values(worker=worker, lease_expires_at=now + timedelta(seconds=lease_s), heartbeat_at=now))
    return commit_if_won(s, stmt)


def touch_queued(s: Session, job_id: str, index: int, older_than_s: float) -> bool:
    """Reconciler: restart a queued shard's waiting clock if it has waited longer than older_than_s.

    True for the one caller that should re-enqueue it, so that many reconcilers running
    at once (one per worker) send one message per shard per grace period, not one each.
    """
    now = utcnow()
    stmt = (update(Shard)
            .where(Shard.job_id == job_id, Shard.index == index, Shard.status == ShardStatus.QUEUED,
                   or_(Shard.lease_expires_at.is_(None),
                       Shard.lease_expires_at < now - timedelta(seconds=older_than_s)))
            .values(lease_expires_at=now))
    return commit_if_won(s, stmt)


def cancel_orphaned_shards(s: Session) -> list[tuple[str, int]]:
    """Queued shards of cancelling (or expiring) jobs → cancelled; returns them.

    request_cancel cancels the shards queued at that moment; a running shard of a
    cancelling job whose worker died is put back to queued by expired_shards, and no
    worker may claim it any more, so it would keep the job from ever finalizing.
    """
    cancelling = select(Job.id).where(Job.status.in_(JobStatus.stopping()))
    rows = s.execute(
        update(Shard)
        .where(Shard.status == ShardStatus.QUEUED, Shard.job_id.in_(cancelling))
        .values(status=ShardStatus.CANCELLED, finished_at=utcnow())
        .returning(Shard.job_id, Shard.index),
        execution_options={"synchronize_session": False}).all()
    s.commit()
    return sorted((job_id, index) for job_id, index in rows)


def unfinalized_jobs(s: Session) -> list[str]:
    """Jobs whose shards have all ended but that nobody finalized (the finalizer died)."""
    unfinished = (select(Shard.index)
                  .where(Shard.job_id == Job.id, Shard.status.in_(ShardStatus.unfinished()))
                  .exists())
    ids = list(s.scalars(
        select(Job.id)
        .where(Job.finalizing_at.is_(None), ~unfinished,
               Job.status.in_((*JobStatus.live(), *JobStatus.stopping())))
        .order_by(Job.id)))
    s.commit()
    return ids


def retake_finalize(s: Session, job_id: str, older_than_s: float) -> bool:
    """Claim again the finalization of a job stuck in it for longer than older_than_s
    (its finalizer died between try_finalize and finish_job). One caller wins."""
    now = utcnow()
    stmt = (update(Job)
            .where(Job.id == job_id, Job.finished_at.is_(None),
                   Job.status.in_((JobStatus.FINALIZING, *JobStatus.stopping())),
                   Job.finalizing_at < now - timedelta(seconds=older_than_s))
            .values(finalizing_at=now))
    return commit_if_won(s, stmt)


def stale_finalizing_jobs(s: Session, older_than_s: float) -> list[str]:
    """Jobs whose finalization was claimed more than older_than_s ago and never finished."""
    cutoff = utcnow() - timedelta(seconds=older_than_s)
    ids = list(s.scalars(
        select(Job.id)
        .where(Job.finished_at.is_(None), Job.finalizing_at < cutoff,
               Job.status.in_((JobStatus.FINALIZING, *JobStatus.stopping())))
        .order_by(Job.id)))
    s.commit()
    return ids


def active_jobs(s: Session) -> list[str]:
    """Ids of the jobs that have not ended."""
    ids = list(s.scalars(select(Job.id).where(Job.status.not_in(JobStatus.terminal())).order_by(Job.id)))
    s.commit()
    return ids


class Route(NamedTuple):
    """Where a job's shards are sent: the queue `<queue>.<engine_key>` with its priority.
    queue None: the job has no prefix of its own (run in-process, or made before 0007)."""
    queue: str | None
    engine_key: str | None
    priority: str


def routes(s: Session, job_ids) -> dict[str, Route]:
    """job id -> the route its shards are sent on (its submitted queue, engine key, priority)."""
    ids = sorted(set(job_ids))
    rows = (s.execute(select(Job.id, Job.queue, Job.engine_key, Job.priority).where(Job.id.in_(ids))).all()
            if ids else [])
    s.commit()
    return {job_id: Route(queue, key, priority) for job_id, queue, key, priority in rows}


def shard_routes(s: Session, shards) -> dict[tuple[str, int], Route]:
    """(job id, index) -> the route that shard is sent on: its job's, on its own engine's queue
    where it has one (a several-model job's shard: Shard.engine_key)."""
    wanted = set(shards)
    by_job = routes(s, (job_id for job_id, _ in wanted))
    own: dict[tuple[str, int], str] = {}
    job_ids = sorted({job_id for job_id, _ in wanted})
    for start in range(0, len(job_ids), 500):   # only several-model jobs' shards have a key of their own
        stmt = select(Shard.job_id, Shard.index, Shard.engine_key).where(
            Shard.job_id.in_(job_ids[start:start + 500]), Shard.engine_key.is_not(None))
        own.update(((job_id, index), key) for job_id, index, key in s.execute(stmt))
    s.commit()
    return {shard: by_job[shard[0]]._replace(engine_key=own.get(shard, by_job[shard[0]].engine_key))
            for shard in wanted if shard[0] in by_job}
