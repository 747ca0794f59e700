"""Deleting old jobs' results (`pipeline gc`), together with their stored answers' index.

A job that ended (completed, failed, cancelled, expired) longer ago than the age given
loses its results directory and its stats; its ledger row stays (the counts, the
lineage of later jobs' reused rows that name it). Its index entries go first, in their
own transaction, so a later job never looks for answers in results about to go; a lookup
that raced with the deletion finds the file gone and computes the request instead.
"""
from __future__ import annotations

import shutil
from datetime import datetime, timedelta

from sqlalchemy import select

from jobs import ledger
from jobs.ledger.models import Job, utcnow
from jobs.paths import JobPaths
from jobs.ledger.statuses import JobStatus


def collect_garbage(Session, root, older_than: timedelta, *, now: datetime | None = None) -> list[str]:
    """Delete the results of the jobs that ended before now - older_than; their ids."""
    cutoff = (now or utcnow()) - older_than
    with Session() as s:
        ids = list(s.scalars(select(Job.id).where(Job.status.in_([st.value for st in JobStatus.terminal()]),
                                                  Job.finished_at < cutoff)))
        s.commit()
    deleted = []
    for job_id in ids:
        paths = JobPaths(root, job_id)
        if not paths.results_dir.exists() and not paths.stats_file.exists():
            continue
        with Session() as s:
            ledger.delete_answers(s, [job_id])
        shutil.rmtree(paths.results_dir, ignore_errors=True)
        paths.stats_file.unlink(missing_ok=True)
        deleted.append(job_id)
    return deleted
