"""The job state machine: create, read, cancel, claim the finalization, finish."""
from __future__ import annotations

from typing import Any

from sqlalchemy import case, func, select, tuple_, update
from sqlalchemy.orm import Session

from jobs import paths
from jobs.ledger.conditional import commit_if_won, execute
from jobs.ledger.models import INPUT_FORMATS, STATS_COLUMNS, Job, JobStatus, Shard, ShardStatus, utcnow
from jobs.results.result_row import SHARD_TOTALS
from jobs.scheduling import DEFAULT_PRIORITY, PRIORITIES, parse_window


def create_job(
    s: Session, *, job_id: str, model: str, engine_options: dict, input_format: str,
    endpoint: str | None, input_path: str, results_path: str, shard_size: int,
    shard_sizes: list[int], completion_window: str | None = None, metadata: dict | None = None,
    engine_key: str | None = None, api_key_id: str | None = None, priority: str = DEFAULT_PRIORITY,
    request_timeout_s: float | None = None, queue: str | None = None, reuse: bool = True,
    engine_fingerprint: str | None = None, answer_scope: str | None = None, keep_seconds: int | None = None,
    models: list[dict] | None = None, shard_engines: list[dict | None] | None = None,
) -> Job:
    """Insert a queued job with one queued shard per entry of shard_sizes; engine_key names
    the engine its shards need (pipeline.engine_key), which routes them to a queue;
    api_key_id: the API key that owns it, for jobs made through `pipeline serve`; queue:
    the PIPELINE_QUEUE prefix its shards are sent on (None for a job run in-process).
    A completion_window (jobs.scheduling.parse_window) sets expires_at from now. A job of several
    models: models ([{"model", "engine_options", "engine_key", "engine_fingerprint"} and, where
    given, "served_names"] in order) and shard_engines (per shard, its engine's
    {"engine_key", "engine_options", "engine_fingerprint"}; None: the job's own)."""
    paths.check_job_id(job_id)
    if input_format not in INPUT_FORMATS:
        raise ValueError(f"input_format must be one of {INPUT_FORMATS}, got {input_format!r}")
    if priority not in PRIORITIES:
        raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}, got {priority!r}")
    now = utcnow()
    expires_at = now + parse_window(completion_window) if completion_window else None
    job = Job(
        id=job_id, status=JobStatus.QUEUED, model=model, engine_options=engine_options, engine_key=engine_key,
        queue=queue,
        input_format=input_format, endpoint=endpoint, input_path=str(input_path),
        results_path=str(results_path), shard_size=shard_size, num_shards=len(shard_sizes),
        completion_window=completion_window, metadata_=metadata, api_key_id=api_key_id,
        total_requests=sum(shard_sizes), priority=priority, request_timeout_s=request_timeout_s,
        reuse=reuse, engine_fingerprint=engine_fingerprint, answer_scope=answer_scope,
        created_at=now, expires_at=expires_at, keep_seconds=keep_seconds, models=models,
    )
    s.add(job)
    s.flush()  # the job row must exist before its shards reference it
    engines = shard_engines or [None] * len(shard_sizes)
    s.add_all(Shard(job_id=job_id, index=i, status=ShardStatus.QUEUED, num_requests=n, **(engines[i] or {}))
              for i, n in enumerate(shard_sizes))
    s.commit()
    return job


def get_job(s: Session, job_id: str) -> Job | None:
    job = s.get(Job, job_id, populate_existing=True)
    s.commit()
    return job


def list_jobs(s: Session, limit: int = 50) -> list[Job]:
    """The newest jobs first."""
    stmt = select(Job).order_by(Job.created_at.desc(), Job.id.desc()).limit(limit)
    jobs = list(s.scalars(stmt.execution_options(populate_existing=True)))
    s.commit()
    return jobs


def jobs_of_key(s: Session, api_key_id: str, *, after: Job | None = None, limit: int = 20) -> list[Job]:
    """An API key's jobs, newest first; with `after`, only those older than it (a cursor)."""
    stmt = select(Job).where(Job.api_key_id == api_key_id)
    if after is not None:
        stmt = stmt.where(tuple_(Job.created_at, Job.id) < (after.created_at, after.id))
    stmt = stmt.order_by(Job.created_at.desc(), Job.id.desc()).limit(limit)
    jobs = list(s.scalars(stmt.execution_options(populate_existing=True)))
    s.commit()
    return jobs


def retries_of(s: Session, job_id: str) -> list[Job]:
    """The jobs made by retrying job_id (metadata {"retry_of": job_id}), oldest first."""
    stmt = (select(Job).where(Job.metadata_["retry_of"].as_string() == job_id)
            .order_by(Job.created_at, Job.id))
    jobs = list(s.scalars(stmt.execution_options(populate_existing=True)))
    s.commit()
    return jobs


def get_shards(s: Session, job_id: str, status: str | None = None) -> list[Shard]:
    """The job's shards in order; status: only those in it (a large job's status page needs
    only its running ones, not thousands of rows)."""
    stmt = select(Shard).where(Shard.job_id == job_id).order_by(Shard.index)
    if status is not None:
        stmt = stmt.where(Shard.status == status)
    shards = list(s.scalars(stmt.execution_options(populate_existing=True)))
    s.commit()
    return shards


def get_shard(s: Session, job_id: str, index: int) -> Shard | None:
    """One shard, by its primary key: a worker starting a shard of a job with thousands of
    shards must not load them all (that held a worker to a third of its rate on a
    1,000,000-line job of 3,907 shards)."""
    shard = s.get(Shard, (job_id, index), populate_existing=True)
    s.commit()
    return shard


def job_counts(s: Session, job_id: str) -> dict:
    """Progress summed over the job's shards, plus the number of shards in each status."""
    keys = ("total_requests", *SHARD_TOTALS)
    columns = ("num_requests", *SHARD_TOTALS)
    rows = s.execute(
        select(Shard.status, func.count(), *(func.sum(getattr(Shard, c)) for c in columns))
        .where(Shard.job_id == job_id).group_by(Shard.status)
    ).all()
    s.commit()
    counts: dict[str, Any] = dict.fromkeys(keys, 0)
    counts["shards"] = {}
    for status, n_shards, *sums in rows:
        counts["shards"][status] = n_shards
        for key, value in zip(keys, sums):
            counts[key] += int(value or 0)
    return counts


def job_as_dict(job: Job) -> dict:
    """Every column of the job keyed by column name (so ``metadata``), datetimes kept."""
    return {attr.columns[0].name: getattr(job, attr.key) for attr in Job.__mapper__.column_attrs}


def is_cancelling(s: Session, job_id: str) -> bool:
    """True once cancellation was requested (cancelling or cancelled)."""
    status = s.scalar(select(Job.status).where(Job.id == job_id))
    s.commit()
    return status in (JobStatus.CANCELLING, JobStatus.CANCELLED)


def stop_reason(s: Session, job_id: str) -> str | None:
    """Why the job's running shards must stop: "cancelled" (cancelling or cancelled) or
    "expired" (expiring or expired: expire_if_due is called first, so a live job past
    its expires_at counts); None while they may go on."""
    expire_if_due(s, job_id)
    status = s.scalar(select(Job.status).where(Job.id == job_id))
    s.commit()
    if status in (JobStatus.CANCELLING, JobStatus.CANCELLED):
        return "cancelled"
    if status in (JobStatus.EXPIRING, JobStatus.EXPIRED):
        return "expired"
    return None


def expire_if_due(s: Session, job_id: str | None = None) -> list[str]:
    """Live jobs (job_id only, or all) whose expires_at has passed → expiring, their queued
    shards → cancelled (they never run; the finalizer writes their error rows). Returns
    the jobs this call expired; the caller should then finalize them, as after a cancel."""
    now = utcnow()
    due = select(Job.id).where(Job.status.in_(JobStatus.live()), Job.expires_at.is_not(None), Job.expires_at <= now)
    if job_id is not None:
        due = due.where(Job.id == job_id)
    expired = []
    for candidate in s.scalars(due).all():
        # Shards before the job row: the lock order of claim/commit and request_cancel.
        execute(s, update(Shard)
                 .where(Shard.job_id == candidate, Shard.status == ShardStatus.QUEUED)
                 .values(status=ShardStatus.CANCELLED, finished_at=now))
        won = execute(s, update(Job)
                       .where(Job.id == candidate, Job.status.in_(JobStatus.live()))
                       .values(status=JobStatus.EXPIRING, cancelling_at=now)).rowcount == 1
        if won:
            s.commit()
            expired.append(candidate)
        else:
            s.rollback()
    s.commit()
    return expired


def count_error_rows(s: Session, job_id: str, index: int, n: int) -> None:
    """Count the n error rows the finalizer wrote for a shard that ended without results
    (it never ran before its job expired, or it was given up unread)."""
    execute(s, update(Shard).where(Shard.job_id == job_id, Shard.index == index).values(failed_requests=n))
    s.commit()


def queued_requests(s: Session) -> int:
    """Requests in queued shards of live jobs: the queue back-pressure limits."""
    total = s.scalar(select(func.coalesce(func.sum(Shard.num_requests), 0)).join(Job, Job.id == Shard.job_id)
                     .where(Shard.status == ShardStatus.QUEUED, Job.status.in_(JobStatus.live())))
    s.commit()
    return int(total)


def request_cancel(s: Session, job_id: str) -> bool:
    """queued|in_progress → cancelling, and its queued shards → cancelled.

    Shards already running finish as "cancelled" through commit_shard when their worker
    notices (is_cancelling). The caller should then try_finalize, which may win at once
    when no shard was running.
    """
    now = utcnow()
    # Shards before the job row: the same lock order as claim/commit, so PostgreSQL cannot deadlock.
    execute(s, update(Shard)
             .where(Shard.job_id == job_id, Shard.status == ShardStatus.QUEUED)
             .values(status=ShardStatus.CANCELLED, finished_at=now))
    won = execute(s, update(Job)
                   .where(Job.id == job_id, Job.status.in_(
                       JobStatus.live()))
                   .values(status=JobStatus.CANCELLING, cancelling_at=now)).rowcount == 1
    if won:
        s.commit()
    else:
        s.rollback()
    return won


def try_finalize(s: Session, job_id: str) -> bool:
    """Claim the job's finalization once none of its shards is queued or running.

    Exactly one caller gets True: queued|in_progress jobs move to finalizing, cancelling
    and expiring jobs stay so; finalizing_at marks the claim in every case. The winner
    computes the stats and calls finish_job.
    """
    unfinished = (select(Shard.index)
                  .where(Shard.job_id == job_id,
                         Shard.status.in_(ShardStatus.unfinished()))
                  .exists())
    stmt = (update(Job)
            .where(Job.id == job_id, Job.finalizing_at.is_(None), ~unfinished,
                   Job.status.in_((*JobStatus.live(), *JobStatus.stopping())))
            .values(finalizing_at=utcnow(),
                    status=case((Job.status.in_(JobStatus.stopping()), Job.status),
                                else_=JobStatus.FINALIZING)))
    return commit_if_won(s, stmt)


def finish_job(s: Session, job_id: str, status: str, stats: dict | None, error: str | None = None) -> bool:
    """finalizing → completed|failed, cancelling → cancelled|failed, or expiring →
    expired|failed, with the stats columns.

    stats is compute_stats()'s dict; its total_requests is ignored (the ledger keeps the
    number of input requests), any other key must be one of STATS_COLUMNS, or models (a job of
    several models: jobs.models with each model's figures).
    """
    allowed_from = {
        JobStatus.COMPLETED: (JobStatus.FINALIZING,),
        JobStatus.CANCELLED: (JobStatus.CANCELLING,),
        JobStatus.EXPIRED: (JobStatus.EXPIRING,),
        JobStatus.FAILED: (JobStatus.FINALIZING, *JobStatus.stopping()),
    }
    if status not in allowed_from:
        raise ValueError(f"cannot finish a job as {status!r}")
    values = {k: v for k, v in (stats or {}).items() if k != "total_requests"}
    if values.get("models", ...) is None:   # models: a several-model job's figures per model (jobs.models)
        values.pop("models")
    unknown = set(values) - set(STATS_COLUMNS) - {"models"}
    if unknown:
        raise ValueError(f"unknown stats keys: {sorted(unknown)}")
    stmt = (update(Job)
            .where(Job.id == job_id, Job.status.in_(allowed_from[status]))
            .values(status=status, finished_at=utcnow(), error=error, **values))
    return commit_if_won(s, stmt)
