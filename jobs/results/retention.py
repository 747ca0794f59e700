"""Deleting old jobs' results (`pipeline gc`), together with their stored answers' index, and
retention: the results and files past their keep (expire_results, from the recovery sweep).

A job that ended (completed, failed, cancelled, expired) longer ago than the age given
loses its results directory and its stats; its ledger row stays (the counts, the
lineage of later jobs' reused rows that name it). Its index entries go first, in their
own transaction, so a later job never looks for answers in results about to go; a lookup
that raced with the deletion finds the file gone and computes the request instead.

Retention deletes the same way, once a job's keep (`--keep`, output_expires_after,
PIPELINE_KEEP_RESULTS) has passed since it ended, and records it in the job's results_expired_at;
with them go its batch output files, and any API file past its own expires_at.
"""
from __future__ import annotations

import shutil
from datetime import datetime, timedelta

from sqlalchemy import select

from jobs import ledger
from jobs.ledger.models import Job, utcnow
from jobs.paths import JobPaths, file_path
from jobs.ledger.statuses import JobStatus


def collect_garbage(Session, root, older_than: timedelta, *, now: datetime | None = None) -> list[str]:
    """Delete the results of the jobs that ended before now - older_than; their ids."""
    cutoff = (now or utcnow()) - older_than
    with Session() as s:
        ids = list(s.scalars(select(Job.id).where(Job.status.in_([st.value for st in JobStatus.terminal()]),
                                                  Job.finished_at < cutoff)))
        s.commit()
    return [job_id for job_id in ids if delete_results(Session, root, job_id)]


def delete_results(Session, root, job_id: str) -> bool:
    """Delete the job's index entries, then its results directory and stats; False if
    there were neither results nor stats (deleted already)."""
    paths = JobPaths(root, job_id)
    if not paths.results_dir.exists() and not paths.stats_file.exists():
        return False
    with Session() as s:
        ledger.delete_answers(s, [job_id])
    shutil.rmtree(paths.results_dir, ignore_errors=True)
    paths.stats_file.unlink(missing_ok=True)
    return True


def expire_results(Session, root, *, now: datetime | None = None) -> dict:
    """Delete what is past its keep: the results (and index entries, and batch output files)
    of every ended job whose keep has passed since it ended, its results_expired_at set; and every
    API file past its expires_at. Returns {"results_expired": job ids, "files_expired": file ids}.
    Safe in many processes at once: each deletion is idempotent, each mark conditional."""
    now = now or utcnow()
    with Session() as s:
        due = ledger.results_due(s, now)
    expired = []
    for job_id in due:
        delete_results(Session, root, job_id)
        with Session() as s:
            outputs = [f.id for f in ledger.files_of_job(s, job_id) if f.deleted_at is None]
        for file_id in outputs:
            _delete_file(Session, root, file_id)
        with Session() as s:
            if ledger.mark_results_expired(s, job_id):
                expired.append(job_id)
    with Session() as s:
        files = ledger.expired_files(s, now)
    return {"results_expired": expired,
            "files_expired": [file_id for file_id in files if _delete_file(Session, root, file_id)]}


def _delete_file(Session, root, file_id: str) -> bool:
    """Mark the API file deleted, then remove its bytes; True if this call marked it."""
    with Session() as s:
        won = ledger.delete_file(s, file_id)
    file_path(root, file_id).unlink(missing_ok=True)
    return won
