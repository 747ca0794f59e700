"""The recovery pass's sweep of results/_tmp never takes the files a finalizer is writing:
the rows of an expired job's never-run shards go straight to their place."""
from __future__ import annotations

import json
import threading
from datetime import timedelta

from sqlalchemy import update

from jobs.results.finalize import finalize_job
from jobs.ledger import Job, expire_if_due, get_job, utcnow
from jobs.paths import JobPaths
from jobs.results.parquet_files import read_results
from jobs.submission import create_job_from_file
from workers.recovery import sweep_tmp


def test_an_expired_jobs_rows_are_written_whole_while_the_sweep_runs(ledger, data_root, tmp_path):
    _, Session = ledger
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"r{i}", "prompt": "Hi", "n": 1 + i % 2}) + "\n" for i in range(60)))
    job_id, _ = create_job_from_file(Session, data_root, src, model="tiny", engine_options={}, shard_size=1,
                                     completion_window="24h")
    with Session() as s:   # its window passed before any shard ran
        s.execute(update(Job).where(Job.id == job_id).values(expires_at=utcnow() - timedelta(seconds=1)))
        s.commit()
        assert expire_if_due(s, job_id) == [job_id]
    stop, swept, errors = threading.Event(), [], []

    def sweep():   # as a recovery pass on another process would, as often as it can
        while not stop.is_set():
            try:
                swept.append(sweep_tmp(Session, data_root, job_id))
            except Exception as e:   # noqa: BLE001 (reported below)
                errors.append(e)

    sweeper = threading.Thread(target=sweep)
    sweeper.start()
    try:
        assert finalize_job(Session, data_root, job_id)
    finally:
        stop.set()
        sweeper.join(30)
    assert not errors and len(swept) > 1
    with Session() as s:
        job = get_job(s, job_id)
        assert (job.status, job.failed_requests, job.completed_requests) == ("expired", 60, 0)
    rows = read_results(JobPaths(data_root, job_id).results_dir).to_pylist()
    assert sorted((r["id"], r["choice"]) for r in rows) == sorted(
        (f"r{i}", c) for i in range(60) for c in range(1 + i % 2))
    assert all(r["finish_reason"] == "error" for r in rows)
