"""The job ledger: SQLAlchemy models for jobs and shards, and the operations on them.

Works on SQLite (the single-machine default) and PostgreSQL (shared by workers on
many machines). Every state transition is one conditional ``UPDATE ... WHERE
<expected state>`` whose rowcount says whether this caller won, so two workers can
never both claim a shard, commit the same shard, or finalize the same job.

Decisions:

* ``Shard.attempt`` is a fencing token: it only ever increases, and renewing or
  committing requires the caller's attempt to be the current one. A graceful
  ``release_shard`` (SIGTERM) increments ``Shard.releases`` instead of decrementing
  the attempt, and ``max_attempts`` counts ``attempt - releases``, so a shutdown does
  not use up an attempt yet a released worker can never commit over its successor.
* While a shard is queued, ``lease_expires_at`` holds when it was last (re)queued: the
  end of its last lease, or when a reconciler last re-enqueued it (``touch_queued``);
  null if neither. ``queued_shards`` uses it to tell how long it has waited.
* Recovery (workers.recovery) is built from conditional updates too: the reaper's
  ``expired_shards`` and ``take_over_expired``, the reconciler's ``queued_shards`` and
  ``touch_queued``, ``cancel_orphaned_shards``, ``unfinalized_jobs`` and
  ``retake_finalize``; many recovery passes at once each win a given step once.
* OpenAI semantics for the job outcome: a job that ran to the end is ``completed``
  even if some (or all) requests or shards failed — failures are error rows in the
  results. ``failed`` is for the batch itself failing (e.g. the model cannot load),
  decided by the caller of ``finish_job``.
* Timestamps come from the caller's clock (UTC); hosts sharing a PostgreSQL ledger
  need synchronised clocks, with leases much longer than any skew.
"""
from __future__ import annotations

import os
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import (
    JSON, DateTime, Engine, Float, ForeignKey, Index, Integer, MetaData, String, Text,
    TypeDecorator, and_, case, create_engine, event, func, or_, select, update,
)
from sqlalchemy.engine import make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from jobs import paths


class JobStatus:
    """Job lifecycle (OpenAI batch statuses)."""

    VALIDATING = "validating"
    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    TERMINAL = frozenset({COMPLETED, FAILED, CANCELLED, EXPIRED})


class ShardStatus:
    """Shard lifecycle."""

    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TERMINAL = frozenset({COMPLETED, FAILED, CANCELLED})


INPUT_FORMATS = ("pipeline", "openai")
# Ledger columns filled from jobs.stats.compute_stats by finish_job. total_requests is
# left out on purpose: it stays the number of input requests.
STATS_COLUMNS = (
    "completed_requests", "failed_requests", "prompt_tokens", "output_tokens",
    "wall_seconds", "output_tok_s", "total_tok_s",
    "latency_p50", "latency_p95", "latency_p99", "ttft_p50", "ttft_p95",
)


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class UTCDateTime(TypeDecorator):
    """Stores UTC and always returns aware datetimes (SQLite would drop the zone)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to the ledger; use an aware UTC datetime")
        value = value.astimezone(timezone.utc)
        # SQLite keeps text without an offset; always-UTC text compares correctly.
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "pk": "pk_%(table_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    })


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String, primary_key=True)
    status: Mapped[str] = mapped_column(String, index=True)
    model: Mapped[str] = mapped_column(String)
    engine_options: Mapped[dict] = mapped_column(JSON)
    input_format: Mapped[str] = mapped_column(String)
    endpoint: Mapped[str | None] = mapped_column(String)
    input_path: Mapped[str] = mapped_column(String)
    results_path: Mapped[str] = mapped_column(String)
    shard_size: Mapped[int] = mapped_column(Integer)
    num_shards: Mapped[int] = mapped_column(Integer)
    completion_window: Mapped[str | None] = mapped_column(String)
    metadata_: Mapped[dict | None] = mapped_column("metadata", JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finalizing_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    cancelling_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    total_requests: Mapped[int] = mapped_column(Integer, default=0)
    completed_requests: Mapped[int] = mapped_column(Integer, default=0)
    failed_requests: Mapped[int] = mapped_column(Integer, default=0)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    output_tokens: Mapped[int] = mapped_column(Integer, default=0)
    wall_seconds: Mapped[float | None] = mapped_column(Float)
    output_tok_s: Mapped[float | None] = mapped_column(Float)
    total_tok_s: Mapped[float | None] = mapped_column(Float)
    latency_p50: Mapped[float | None] = mapped_column(Float)
    latency_p95: Mapped[float | None] = mapped_column(Float)
    latency_p99: Mapped[float | None] = mapped_column(Float)
    ttft_p50: Mapped[float | None] = mapped_column(Float)
    ttft_p95: Mapped[float | None] = mapped_column(Float)
    error: Mapped[str | None] = mapped_column(Text)


class Shard(Base):
    __tablename__ = "shards"
    __table_args__ = (Index("ix_shards_status_lease", "status", "lease_expires_at"),)

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    index: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    status: Mapped[str] = mapped_column(String)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    releases: Mapped[int] = mapped_column(Integer, default=0)
    num_requests: Mapped[int] = mapped_column(Integer, default=0)
    completed_requests: Mapped[int] = mapped_column(Integer, default=0)
    failed_requests: Mapped[int] = mapped_column(Integer, default=0)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    output_tokens: Mapped[int] = mapped_column(Integer, default=0)
    worker: Mapped[str | None] = mapped_column(String)
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    error: Mapped[str | None] = mapped_column(Text)


# --- engine, sessions, schema -------------------------------------------------------------

def make_engine(url: str | None = None) -> Engine:
    """An engine for the ledger at url (default: paths.database_url())."""
    url = make_url(url or paths.database_url())
    if url.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True)
    if url.database and url.database != ":memory:":
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _sqlite_pragmas(dbapi_conn, _record) -> None:
        # WAL lets readers run beside the writer; busy_timeout makes writers queue, not fail.
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    return engine


def session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions whose objects stay readable after the commit each ledger function ends with."""
    return sessionmaker(engine, expire_on_commit=False)


def upgrade(url: str | None = None, revision: str = "head") -> None:
    """Run the Alembic migrations up to revision (no alembic.ini needed)."""
    from alembic import command

    from migrations import alembic_config
    command.upgrade(alembic_config(url or paths.database_url()), revision)


def ensure_schema(url: str | None = None) -> None:
    """Upgrade the ledger at url unless it is already at the head revision."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    from migrations import alembic_config
    url = url or paths.database_url()
    head = ScriptDirectory.from_config(alembic_config(url)).get_current_head()
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            current = MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()
    if current != head:
        upgrade(url)


# --- jobs ---------------------------------------------------------------------------------

def create_job(
    s: Session, *, job_id: str, model: str, engine_options: dict, input_format: str,
    endpoint: str | None, input_path: str, results_path: str, shard_size: int,
    shard_sizes: list[int], completion_window: str | None = None, metadata: dict | None = None,
) -> Job:
    """Insert a queued job with one queued shard per entry of shard_sizes."""
    paths.check_job_id(job_id)
    if input_format not in INPUT_FORMATS:
        raise ValueError(f"input_format must be one of {INPUT_FORMATS}, got {input_format!r}")
    job = Job(
        id=job_id, status=JobStatus.QUEUED, model=model, engine_options=engine_options,
        input_format=input_format, endpoint=endpoint, input_path=str(input_path),
        results_path=str(results_path), shard_size=shard_size, num_shards=len(shard_sizes),
        completion_window=completion_window, metadata_=metadata,
        total_requests=sum(shard_sizes),
    )
    s.add(job)
    s.flush()  # the job row must exist before its shards reference it
    s.add_all(Shard(job_id=job_id, index=i, status=ShardStatus.QUEUED, num_requests=n)
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


def get_shards(s: Session, job_id: str) -> list[Shard]:
    stmt = select(Shard).where(Shard.job_id == job_id).order_by(Shard.index)
    shards = list(s.scalars(stmt.execution_options(populate_existing=True)))
    s.commit()
    return shards


def job_counts(s: Session, job_id: str) -> dict:
    """Progress summed over the job's shards, plus the number of shards in each status."""
    rows = s.execute(
        select(Shard.status, func.count(), func.sum(Shard.num_requests),
               func.sum(Shard.completed_requests), func.sum(Shard.failed_requests),
               func.sum(Shard.prompt_tokens), func.sum(Shard.output_tokens))
        .where(Shard.job_id == job_id).group_by(Shard.status)
    ).all()
    s.commit()
    keys = ("total_requests", "completed_requests", "failed_requests", "prompt_tokens", "output_tokens")
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


def request_cancel(s: Session, job_id: str) -> bool:
    """validating|queued|in_progress → cancelling, and its queued shards → cancelled.

    Shards already running finish as "cancelled" through commit_shard when their worker
    notices (is_cancelling). The caller should then try_finalize, which may win at once
    when no shard was running.
    """
    now = utcnow()
    # Shards before the job row: the same lock order as claim/commit, so PostgreSQL cannot deadlock.
    _execute(s, update(Shard)
             .where(Shard.job_id == job_id, Shard.status == ShardStatus.QUEUED)
             .values(status=ShardStatus.CANCELLED, finished_at=now))
    won = _execute(s, update(Job)
                   .where(Job.id == job_id, Job.status.in_(
                       (JobStatus.VALIDATING, JobStatus.QUEUED, JobStatus.IN_PROGRESS)))
                   .values(status=JobStatus.CANCELLING, cancelling_at=now)).rowcount == 1
    if won:
        s.commit()
    else:
        s.rollback()
    return won


def try_finalize(s: Session, job_id: str) -> bool:
    """Claim the job's finalization once none of its shards is queued or running.

    Exactly one caller gets True: queued|in_progress jobs move to finalizing, cancelling
    jobs stay cancelling; finalizing_at marks the claim in both cases. The winner
    computes the stats and calls finish_job.
    """
    unfinished = (select(Shard.index)
                  .where(Shard.job_id == job_id,
                         Shard.status.in_((ShardStatus.QUEUED, ShardStatus.RUNNING)))
                  .exists())
    stmt = (update(Job)
            .where(Job.id == job_id, Job.finalizing_at.is_(None), ~unfinished,
                   Job.status.in_((JobStatus.QUEUED, JobStatus.IN_PROGRESS, JobStatus.CANCELLING)))
            .values(finalizing_at=utcnow(),
                    status=case((Job.status == JobStatus.CANCELLING, JobStatus.CANCELLING),
                                else_=JobStatus.FINALIZING)))
    return _commit_if_won(s, stmt)


def finish_job(s: Session, job_id: str, status: str, stats: dict | None, error: str | None = None) -> bool:
    """finalizing → completed|failed, or cancelling → cancelled|failed, with the stats columns.

    stats is compute_stats()'s dict; its total_requests is ignored (the ledger keeps the
    number of input requests), any other key must be one of STATS_COLUMNS.
    """
    allowed_from = {
        JobStatus.COMPLETED: (JobStatus.FINALIZING,),
        JobStatus.CANCELLED: (JobStatus.CANCELLING,),
        JobStatus.FAILED: (JobStatus.FINALIZING, JobStatus.CANCELLING),
    }
    if status not in allowed_from:
        raise ValueError(f"cannot finish a job as {status!r}")
    values = {k: v for k, v in (stats or {}).items() if k != "total_requests"}
    unknown = set(values) - set(STATS_COLUMNS)
    if unknown:
        raise ValueError(f"unknown stats keys: {sorted(unknown)}")
    stmt = (update(Job)
            .where(Job.id == job_id, Job.status.in_(allowed_from[status]))
            .values(status=status, finished_at=utcnow(), error=error, **values))
    return _commit_if_won(s, stmt)


# --- shards -------------------------------------------------------------------------------

def claim_shard(s: Session, job_id: str, index: int, worker: str, lease_s: float, max_attempts: int) -> int | None:
    """Lease a queued shard (or one whose lease expired); return its new attempt, else None.

    The attempt is the fencing token to pass to renew/release/commit. Fails while the job
    is not queued/in_progress (e.g. cancelling) or when max_attempts are used up.
    Also moves the job queued → in_progress the first time.
    """
    now = utcnow()
    job_live = (select(Job.id)
                .where(Job.id == job_id, Job.status.in_((JobStatus.QUEUED, JobStatus.IN_PROGRESS)))
                .exists())
    stmt = (update(Shard)
            .where(Shard.job_id == job_id, Shard.index == index, job_live,
                   Shard.attempt - Shard.releases < max_attempts,
                   or_(Shard.status == ShardStatus.QUEUED,
                       and_(Shard.status == ShardStatus.RUNNING, Shard.lease_expires_at < now)))
            .values(status=ShardStatus.RUNNING, attempt=Shard.attempt + 1, worker=worker,
                    lease_expires_at=now + timedelta(seconds=lease_s), heartbeat_at=now,
                    started_at=now, finished_at=None, error=None)
            .returning(Shard.attempt))
    attempt = s.execute(stmt, execution_options={"synchronize_session": False}).scalar()
    if attempt is None:
        s.rollback()
        return None
    _execute(s, update(Job)
             .where(Job.id == job_id, Job.status == JobStatus.QUEUED)
             .values(status=JobStatus.IN_PROGRESS, started_at=now))
    s.commit()
    return attempt


def renew_lease(s: Session, job_id: str, index: int, attempt: int, lease_s: float) -> bool:
    """Extend the lease; False means this worker lost the shard and must stop."""
    now = utcnow()
    stmt = (update(Shard)
            .where(_held(job_id, index, attempt))
            .values(lease_expires_at=now + timedelta(seconds=lease_s), heartbeat_at=now))
    return _commit_if_won(s, stmt)


def release_shard(s: Session, job_id: str, index: int, attempt: int) -> bool:
    """Graceful shutdown: running → queued without using up an attempt (see module doc)."""
    stmt = (update(Shard)
            .where(_held(job_id, index, attempt))
            .values(status=ShardStatus.QUEUED, releases=Shard.releases + 1, worker=None,
                    lease_expires_at=utcnow()))
    return _commit_if_won(s, stmt)


def commit_shard(
    s: Session, job_id: str, index: int, attempt: int, *, completed: int, failed: int,
    prompt_tokens: int, output_tokens: int, tmp_path: str | os.PathLike,
    final_path: str | os.PathLike, status: str = ShardStatus.COMPLETED,
) -> bool:
    """Publish an attempt's results: fenced ledger update and file rename in one transaction.

    status is "completed", "cancelled" (a partial shard of a cancelled job) or "failed"
    (error rows of an exhausted shard). A stale attempt never commits: it gets False and
    its tmp file is deleted. If the database commit fails after the rename, the shard
    stays running and a later attempt overwrites the file, so results stay consistent.
    """
    if status not in ShardStatus.TERMINAL:
        raise ValueError(f"cannot commit a shard as {status!r}")
    counts = dict(completed_requests=completed, failed_requests=failed,
                  prompt_tokens=prompt_tokens, output_tokens=output_tokens)
    won = _execute(s, update(Shard)
                   .where(_held(job_id, index, attempt))
                   .values(status=status, finished_at=utcnow(), lease_expires_at=None, **counts)
                   ).rowcount == 1
    if not won:
        s.rollback()
        Path(tmp_path).unlink(missing_ok=True)
        return False
    try:
        # Running totals on the job row, so progress needs no aggregation.
        _execute(s, update(Job).where(Job.id == job_id).values(
            **{k: getattr(Job, k) + v for k, v in counts.items()}))
        os.replace(tmp_path, final_path)
        _fsync_dir(Path(final_path).parent)
    except BaseException:
        s.rollback()
        raise
    s.commit()
    return True


def fail_shard(s: Session, job_id: str, index: int, attempt: int | None, error: str) -> bool:
    """Mark an unfinished shard failed; with an attempt, only if that attempt still holds it."""
    cond = (_held(job_id, index, attempt) if attempt is not None else
            and_(Shard.job_id == job_id, Shard.index == index,
                 Shard.status.in_((ShardStatus.QUEUED, ShardStatus.RUNNING))))
    stmt = (update(Shard).where(cond)
            .values(status=ShardStatus.FAILED, error=error, finished_at=utcnow(), lease_expires_at=None))
    return _commit_if_won(s, stmt)


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
                .where(_held(job_id, index, attempt), Shard.lease_expires_at < now)
                .values(status=ShardStatus.QUEUED, worker=None))
        if _commit_if_won(s, stmt):
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
               Job.status.in_((JobStatus.QUEUED, JobStatus.IN_PROGRESS)))
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
            .where(_held(job_id, index, attempt), Shard.lease_expires_at < now)
            .values(worker=worker, lease_expires_at=now + timedelta(seconds=lease_s), heartbeat_at=now))
    return _commit_if_won(s, stmt)


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
    return _commit_if_won(s, stmt)


def cancel_orphaned_shards(s: Session) -> list[tuple[str, int]]:
    """Queued shards of cancelling jobs → cancelled; returns them.

    request_cancel cancels the shards queued at that moment; a running shard of a
    cancelling job whose worker died is put back to queued by expired_shards, and no
    worker may claim it any more, so it would keep the job from ever finalizing.
    """
    cancelling = select(Job.id).where(Job.status == JobStatus.CANCELLING)
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
                  .where(Shard.job_id == Job.id, Shard.status.in_((ShardStatus.QUEUED, ShardStatus.RUNNING)))
                  .exists())
    ids = list(s.scalars(
        select(Job.id)
        .where(Job.finalizing_at.is_(None), ~unfinished,
               Job.status.in_((JobStatus.QUEUED, JobStatus.IN_PROGRESS, JobStatus.CANCELLING)))
        .order_by(Job.id)))
    s.commit()
    return ids


def retake_finalize(s: Session, job_id: str, older_than_s: float) -> bool:
    """Claim again the finalization of a job stuck in it for longer than older_than_s
    (its finalizer died between try_finalize and finish_job). One caller wins."""
    now = utcnow()
    stmt = (update(Job)
            .where(Job.id == job_id, Job.finished_at.is_(None),
                   Job.status.in_((JobStatus.FINALIZING, JobStatus.CANCELLING)),
                   Job.finalizing_at < now - timedelta(seconds=older_than_s))
            .values(finalizing_at=now))
    return _commit_if_won(s, stmt)


def stale_finalizing_jobs(s: Session, older_than_s: float) -> list[str]:
    """Jobs whose finalization was claimed more than older_than_s ago and never finished."""
    cutoff = utcnow() - timedelta(seconds=older_than_s)
    ids = list(s.scalars(
        select(Job.id)
        .where(Job.finished_at.is_(None), Job.finalizing_at < cutoff,
               Job.status.in_((JobStatus.FINALIZING, JobStatus.CANCELLING)))
        .order_by(Job.id)))
    s.commit()
    return ids


def active_jobs(s: Session) -> list[str]:
    """Ids of the jobs that have not ended."""
    ids = list(s.scalars(select(Job.id).where(Job.status.not_in(JobStatus.TERMINAL)).order_by(Job.id)))
    s.commit()
    return ids


# --- helpers ------------------------------------------------------------------------------

def _held(job_id: str, index: int, attempt: int):
    """The shard is running under exactly this attempt."""
    return and_(Shard.job_id == job_id, Shard.index == index,
                Shard.status == ShardStatus.RUNNING, Shard.attempt == attempt)


def _execute(s: Session, stmt):
    # Bulk UPDATEs: the ledger re-reads rows (populate_existing) instead of syncing the session.
    return s.execute(stmt, execution_options={"synchronize_session": False})


def _commit_if_won(s: Session, stmt) -> bool:
    won = _execute(s, stmt).rowcount == 1
    if won:
        s.commit()
    else:
        s.rollback()
    return won


def _fsync_dir(directory: Path) -> None:
    """Make a rename durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
