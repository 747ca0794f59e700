"""Ending a job: statistics from its committed results, then its final ledger status.

An expiring job (its completion window passed) ends "expired": first every shard that
never ran gets one error row per request and choice (jobs.scheduling.expired_error), so
each (id, choice) appears exactly once in the results. A job whose requests cannot all get a
row (a shard failed where its input could not be read, and it cannot be read here
either) ends "failed", never "completed".

`finalize_job` is called after every shard commit (and after a cancel); only the caller
that wins ledger.try_finalize does the work. `refinalize_job` finishes a job whose
finalizer died half-way (workers.recovery calls it). `abandon_job` ends a job that cannot run
(model does not load, broker lost, run interrupted).
"""
from __future__ import annotations

from sqlalchemy.orm import Session, sessionmaker

from jobs import ledger
from jobs.results import result_row
from jobs.ledger import JobStatus, ShardStatus
from jobs.paths import JobPaths
from jobs.results.parquet_files import write_final_shard
from jobs.scheduling import expired_error
from jobs.input.shard_files import read_shard
from jobs.results.job_stats import compute_stats, model_counts, write_stats


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
    """Write the stats and the final status of a job whose finalization this caller won.

    No job ends completed (or cancelled, or expired) while a request that ran, or should
    have, has no row: a shard that ended failed without results (given up, its input
    unreadable where it ran) gets its error rows here when its input can be read; when it
    cannot, the job ends failed with a message naming the cause.
    """
    job_paths = JobPaths(root, job_id)
    with Session() as s:
        job = ledger.get_job(s, job_id)
        if job.status == JobStatus.CANCELLING:
            status = JobStatus.CANCELLED
        elif job.status == JobStatus.EXPIRING:
            status = JobStatus.EXPIRED
        missing = _write_missing_rows(s, job_paths, job)
        if missing:
            status, error = JobStatus.FAILED, "; ".join(filter(None, (error, missing)))
        if not job_paths.dir.is_dir():   # never write a stats file where the job's files are not
            ledger.finish_job(s, job_id, status, None, error)
            return
        try:
            wall = (ledger.utcnow() - (job.started_at or job.created_at)).total_seconds()
            stats = compute_stats(job_paths.results_dir, wall, ledger.job_usage(s, job_id))
            if job.models is not None:   # a job of several models: its figures per model too (jobs.models)
                stats["models"] = _per_model(s, job, job_paths)
            write_stats(stats, job_id, job_paths.stats_file)
        except Exception as e:
            # Never leave the job stuck in finalizing: record why it failed instead.
            ledger.finish_job(s, job_id, JobStatus.FAILED, None, f"computing the statistics failed: {e}")
            raise
        ledger.finish_job(s, job_id, status, stats, error)


def _per_model(s, job, job_paths: JobPaths) -> list[dict]:
    """jobs.models with each model's requests and tokens (jobs.results.job_stats.model_counts)."""
    index_of = {model["engine_key"]: i for i, model in enumerate(job.models)}
    shard_models = [index_of.get(shard.engine_key, 0) for shard in ledger.get_shards(s, job.id)]
    return model_counts(job_paths.results_dir, job.models, shard_models)


def _write_missing_rows(s, job_paths: JobPaths, job) -> str | None:
    """Write the rows of the shards that ended without results and should have them; return
    why some could not be written (None when every request that needs a row has one).

    They are the shards of an expiring job that never ran (jobs.scheduling.expired_error
    rows) and failed shards without a results file (their own error as the rows' error).
    Cancelled shards of a cancelled job never ran and have no rows (retry runs them).
    Only the finalizer, which won try_finalize, writes them: no attempt can commit any
    more, as every shard has ended.
    """
    missing: list[str] = []
    for shard in ledger.get_shards(s, job.id):
        final = job_paths.result_shard(shard.index)
        if final.exists():
            continue
        if shard.status == ShardStatus.CANCELLED and job.status == JobStatus.EXPIRING:
            error = expired_error(job.completion_window)
        elif shard.status == ShardStatus.FAILED:
            error = shard.error or "the shard failed"
        elif shard.status == ShardStatus.COMPLETED:
            missing.append(f"shard {shard.index}: its committed results {final} are missing")
            continue
        else:
            continue
        try:
            specs = read_shard(job_paths.input_shard(shard.index))
        except (OSError, ValueError) as e:
            missing.append(f"shard {shard.index} ({shard.num_requests} request(s)) has no results: {error}"
                           + ("" if str(e) in error else f"; its input cannot be read: {e}"))
            continue
        rows = result_row.error_rows(specs, error, shard.index, shard.attempt)
        write_final_shard(rows, final)
        ledger.count_error_rows(s, job.id, shard.index, len(specs))   # requests, whatever their n
    if not missing:
        return None
    lost = len(missing)
    return (f"{lost} shard(s) ended without a row for each of their requests, so the job did not complete: "
            + "; ".join(missing[:3]) + (f"; ... and {lost - 3} more" if lost > 3 else ""))
