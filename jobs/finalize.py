"""Ending a job: statistics from its committed results, then its final ledger status.

`finalize_job` is called after every shard commit (and after a cancel); only the caller
that wins ledger.try_finalize does the work. `refinalize_job` finishes a job whose
finalizer died half-way (workers.recovery calls it). `abandon_job` ends a job that cannot run
(model does not load, broker lost, run interrupted).
"""
from __future__ import annotations

from sqlalchemy.orm import Session, sessionmaker

from jobs import ledger
from jobs.ledger import JobStatus, ShardStatus
from jobs.paths import JobPaths
from jobs.stats import compute_stats, write_stats


def finalize_job(Session: sessionmaker[Session], root, job_id: str) -> bool:
    """If no shard is left to run, finish the job (completed, or cancelled if cancelling).

    Returns True for the one caller that finished it.
    """
    with Session() as s:
        if not ledger.try_finalize(s, job_id):
            return False
    _finish(Session, root, job_id, JobStatus.COMPLETED, error=None)
    return True


def refinalize_job(Session: sessionmaker[Session], root, job_id: str, older_than_s: float) -> bool:
    """Finish a job whose finalizer died after claiming it more than older_than_s ago.

    Returns True for the one caller that finished it (recovery: workers.recovery).
    """
    with Session() as s:
        if not ledger.retake_finalize(s, job_id, older_than_s):
            return False
    _finish(Session, root, job_id, JobStatus.COMPLETED, error=None)
    return True


def abandon_job(Session: sessionmaker[Session], root, job_id: str, error: str) -> bool:
    """Fail every unfinished shard with `error`, then finish the job as failed (cancelled if
    cancelling), with the stats of whatever was committed. True if this call finished it."""
    with Session() as s:
        for shard in ledger.get_shards(s, job_id):
            if shard.status in ShardStatus.unfinished():
                ledger.fail_shard(s, job_id, shard.index, None, error)
        if not ledger.try_finalize(s, job_id):
            return False
    _finish(Session, root, job_id, JobStatus.FAILED, error=error)
    return True


def _finish(Session, root, job_id: str, status: str, error: str | None) -> None:
    """Write the stats and the final status of a job whose finalization this caller won."""
    job_paths = JobPaths(root, job_id)
    with Session() as s:
        job = ledger.get_job(s, job_id)
        if job.status == JobStatus.CANCELLING:
            status = JobStatus.CANCELLED
        try:
            wall = (ledger.utcnow() - (job.started_at or job.created_at)).total_seconds()
            stats = compute_stats(job_paths.results_dir, wall)
            write_stats(stats, job_id, job_paths.stats_file)
        except Exception as e:
            # Never leave the job stuck in finalizing: record why it failed instead.
            ledger.finish_job(s, job_id, JobStatus.FAILED, None, f"computing the statistics failed: {e}")
            raise
        ledger.finish_job(s, job_id, status, stats, error)
