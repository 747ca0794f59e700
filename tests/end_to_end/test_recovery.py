"""The recovery pass, in process and as `pipeline recover`: the reaper's error rows, orphans
re-enqueued on their job's own queue, a dead finalizer, exhausted attempts; and a job never
ends completed without a row for each of its requests (a worker that cannot read its
files, a shard given up where its input was not readable)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

from jobs.ledger import get_job, get_shards, make_engine, session_factory, upgrade
from jobs.paths import JobPaths
from jobs.results.parquet_files import read_results
from jobs.submission import create_job_from_file
from ledger_helpers import job_of_a_dead_worker
from worker_process import drop_queue
from cluster import REPO, write_jsonl


def test_jobs_and_recovery_import_neither_celery_nor_torch():
    code = ("import sys, jobs.submission, jobs.results.finalize, jobs.ledger, workers.recovery; "
            "print(sorted({'celery', 'torch'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert done.stdout.strip() == "[]"


# --- recovery in-process: the reaper's error rows, orphans, a dead finalizer --------------------

def test_recover_pass_reaps_fails_and_finalizes(db_url, data_root, tmp_path):
    from datetime import timedelta

    from sqlalchemy import update

    from jobs.ledger import Job, Shard, claim_shard, request_cancel, try_finalize, utcnow
    from workers.recovery import recover

    engine = make_engine(db_url)
    Session = session_factory(engine)
    sent: list[tuple[str, int]] = []
    pass_ = dict(max_attempts=2, queued_grace_s=5, enqueue=lambda route, shards: sent.extend(shards),
                 backlog=lambda route: 0)
    try:
        src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": "Hi"} for i in range(5)])
        job_id = create_job_from_file(Session, data_root, src, model="tiny", engine_options={}, shard_size=2)[0]
        past = utcnow() - timedelta(seconds=60)
        with Session() as s:
            for index in (0, 1):  # shard 0: one attempt used, shard 1: both
                for _ in range(index + 1):
                    s.execute(update(Shard).where(Shard.job_id == job_id, Shard.index == index)
                              .values(status="queued"))
                    s.commit()
                    assert claim_shard(s, job_id, index, "dead-worker:1", 60, 2)
            s.execute(update(Shard).where(Shard.job_id == job_id, Shard.index.in_((0, 1)))
                      .values(lease_expires_at=past))
            s.execute(update(Job).where(Job.id == job_id).values(created_at=past))
            s.commit()
        # a stale tmp file of the dead attempt of shard 0
        jp = JobPaths(data_root, job_id)
        jp.tmp_dir.mkdir(parents=True)
        jp.tmp_result(0, 1).write_bytes(b"partial")
        report = recover(Session, data_root, **pass_)
        assert report["requeued"] == [(job_id, 0)] and report["exhausted"] == [(job_id, 1)]
        assert sorted(sent) == [(job_id, 0), (job_id, 2)] and report["reenqueued"] == [(job_id, 2)]
        assert report["tmp_removed"] == 1 and not list(jp.tmp_dir.glob("*"))
        rows = read_results(jp.results_dir).to_pylist()
        assert [r["id"] for r in rows] == ["r2", "r3"] and {r["finish_reason"] for r in rows} == {"error"}
        assert all(r["attempt"] == 2 and "2 attempts" in r["error"] for r in rows)
        with Session() as s:
            shards = get_shards(s, job_id)
            assert [(sh.status, sh.failed_requests) for sh in shards] == [("queued", 0), ("failed", 2), ("queued", 0)]
        # the reconciler does not send the same shard again within the grace period, nor while the queue is busy
        sent.clear()
        assert recover(Session, data_root, **pass_)["reenqueued"] == [] and sent == []
        # cancel while shard 2 runs; its worker dies: the reaper requeues it, it is cancelled, the job ends
        with Session() as s:
            assert claim_shard(s, job_id, 2, "dead-worker:2", 60, 2) == 1
            assert request_cancel(s, job_id)  # cancels the queued shard 0 at once
            s.execute(update(Shard).where(Shard.job_id == job_id, Shard.index == 2).values(lease_expires_at=past))
            s.commit()
        report = recover(Session, data_root, **pass_)
        assert report["requeued"] == [(job_id, 2)] and report["cancelled"] == [(job_id, 2)]
        assert report["finalized"] == [job_id]
        with Session() as s:
            job = get_job(s, job_id)
            assert (job.status, job.failed_requests) == ("cancelled", 2)
            assert [sh.status for sh in get_shards(s, job_id)] == ["cancelled", "failed", "cancelled"]
        # a finalizer that died after claiming: finished again once its claim is stale
        job2 = create_job_from_file(Session, data_root, src, model="tiny", engine_options={}, shard_size=5)[0]
        with Session() as s:
            s.execute(update(Shard).where(Shard.job_id == job2).values(status="cancelled"))
            s.commit()
            assert try_finalize(s, job2)
            s.execute(update(Job).where(Job.id == job2).values(finalizing_at=past))
            s.commit()
        assert recover(Session, data_root, **pass_, finalize_grace_s=30)["finalized"] == [job2]
        with Session() as s:
            assert get_job(s, job2).status == "completed"
    finally:
        engine.dispose()


def test_pipeline_recover_ends_a_job_whose_worker_died_on_its_last_attempt(data_root, tmp_path):
    """`pipeline recover` (one pass, for cron): no worker is left to reap the shard."""
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    upgrade(url)
    engine = make_engine(url)
    Session = session_factory(engine)
    queue = f"pipeline-ft-{uuid.uuid4().hex[:8]}"
    try:
        job_id = job_of_a_dead_worker(Session, data_root, tmp_path)
        env = {**os.environ, "PIPELINE_DATA_DIR": str(data_root), "PIPELINE_DATABASE_URL": url,
               "PIPELINE_QUEUE": queue, "PIPELINE_MAX_ATTEMPTS": "1"}
        done = subprocess.run([sys.executable, "-m", "cli", "recover"], env=env, cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert report["exhausted"] == [[job_id, 0]] and report["finalized"] == [job_id]
        with Session() as s:
            job = get_job(s, job_id)
        assert (job.status, job.completed_requests, job.failed_requests) == ("completed", 0, 3)
        errors = read_results(JobPaths(data_root, job_id).results_dir)["error"].to_pylist()
        assert len(errors) == 3 and all("gone:1" in e for e in errors)
        env["PIPELINE_BROKER_URL"] = "redis://127.0.0.1:1/0"  # nothing listens there
        done = subprocess.run([sys.executable, "-m", "cli", "recover"], env=env, cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 3 and "cannot reach the broker" in done.stderr
    finally:
        engine.dispose()
        drop_queue(queue)


# --- a job never ends completed without its rows ----------------------------------------------

def test_a_worker_that_cannot_see_the_jobs_files_fails_the_job_naming_why(sqlite_url, cluster_factory, tmp_path):
    """A worker whose PIPELINE_DATA_DIR does not hold the job's files (an unmounted share):
    the shard's error says so, the job ends failed (not completed with no answers), and no
    stats file appears under the worker's own data directory."""
    c = cluster_factory(sqlite_url, PIPELINE_MAX_ATTEMPTS=2)
    wrong = tmp_path / "not-the-share"
    wrong.mkdir()
    c.start_worker(PIPELINE_DATA_DIR=str(wrong))
    job_id = c.submit([{"id": f"r{i}", "prompt": "Hi", "max_tokens": 2} for i in range(4)], shard_size=2)
    job = c.wait_until_ended(job_id)
    assert job.status == "failed", (job.status, job.error, c.all_logs())
    assert "without a row for each of their requests" in job.error and str(wrong) in job.error
    assert "PIPELINE_DATA_DIR" in job.error
    shards = c.shards(job_id)
    assert {sh.status for sh in shards} == {"failed"}
    assert all("cannot read the shard's input" in sh.error for sh in shards), [sh.error for sh in shards]
    assert not (wrong / "jobs").exists() and not JobPaths(c.root, job_id).stats_file.exists()
    done = c.cli("status", job_id)
    assert done.returncode == 0 and "failed" in done.stdout, done.stdout + done.stderr


def test_a_given_up_shard_whose_input_is_readable_here_gets_its_rows(db_url, data_root, tmp_path):
    """The reaper ran where the input was not readable; the finalizer that can read it writes
    the error rows (quoting the attempt's error), so the job completes with a row per request."""
    from sqlalchemy import update

    from jobs.results.finalize import finalize_job
    from jobs.ledger import Shard, claim_shard, fail_shard, note_shard_error

    engine = make_engine(db_url)
    Session = session_factory(engine)
    try:
        src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": "Hi"} for i in range(3)])
        job_id = create_job_from_file(Session, data_root, src, model="tiny", engine_options={}, shard_size=3)[0]
        with Session() as s:
            assert claim_shard(s, job_id, 0, "w:1", 60, 1) == 1
            assert note_shard_error(s, job_id, 0, 1, "OSError: disk on fire")
            assert fail_shard(s, job_id, 0, 1, "the shard failed on each of its 1 attempts; last error: OSError: disk on fire")
        assert finalize_job(Session, data_root, job_id)
        with Session() as s:
            job = get_job(s, job_id)
            assert (job.status, job.failed_requests, job.error) == ("completed", 3, None)
            assert get_shards(s, job_id)[0].failed_requests == 3
        rows = read_results(JobPaths(data_root, job_id).results_dir).to_pylist()
        assert [r["id"] for r in rows] == ["r0", "r1", "r2"]
        assert all(r["finish_reason"] == "error" and "disk on fire" in r["error"] for r in rows)
        # the same with the input gone as well: the job fails, naming the shard and the cause
        job2 = create_job_from_file(Session, data_root, src, model="tiny", engine_options={}, shard_size=3)[0]
        with Session() as s:
            s.execute(update(Shard).where(Shard.job_id == job2).values(status="failed", error="worker gone"))
            s.commit()
        JobPaths(data_root, job2).input_shard(0).unlink()
        assert finalize_job(Session, data_root, job2)
        with Session() as s:
            job = get_job(s, job2)
        assert job.status == "failed" and "shard 0 (3 request(s)) has no results: worker gone" in job.error
        assert "its input cannot be read" in job.error
    finally:
        engine.dispose()


def test_recovery_sends_shards_to_the_queue_their_job_was_submitted_on(db_url, data_root, tmp_path):
    """Workers of two PIPELINE_QUEUE prefixes share a ledger: a reconciler re-sends each
    job's lost shards under that job's own prefix, never under its own."""
    from datetime import timedelta

    from sqlalchemy import update

    from jobs.ledger import Job, utcnow
    from workers.recovery import recover

    engine = make_engine(db_url)
    Session = session_factory(engine)
    sent: list = []
    try:
        src = write_jsonl(tmp_path / "in.jsonl", [{"id": "r0", "prompt": "Hi"}])
        ours = create_job_from_file(Session, data_root, src, model="tiny", engine_options={}, shard_size=1,
                                    queue="team-a")[0]
        theirs = create_job_from_file(Session, data_root, src, model="tiny", engine_options={}, shard_size=1,
                                      queue="team-b")[0]
        with Session() as s:
            s.execute(update(Job).values(created_at=utcnow() - timedelta(seconds=60)))
            s.commit()
        report = recover(Session, data_root, max_attempts=2, queued_grace_s=5,
                         enqueue=lambda route, shards: sent.append((route.queue, shards)),
                         backlog=lambda route: 0)
        assert sorted(report["reenqueued"]) == sorted([(ours, 0), (theirs, 0)])
        assert sorted(sent) == sorted([("team-a", [(ours, 0)]), ("team-b", [(theirs, 0)])])
    finally:
        engine.dispose()
