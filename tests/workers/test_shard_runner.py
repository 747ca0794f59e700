"""workers.shard_runner.run_shard with the real tiny model on SQLite and PostgreSQL:
cancellation mid-shard, a lost lease, requests the engine rejects, and exhausted attempts."""
from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import update

from jobs.ledger import Shard, create_job, get_job, get_shards
from jobs.paths import JobPaths, new_job_id
from jobs.results import read_results
from jobs.paths import input_shard_name as shard_file_name
from workers.shard_runner import run_shard
from shard_helpers import another_worker_takes_over, cancel, run_with_a_quick_request_first, submit


def test_cancel_stops_the_shard_between_steps(ledger, data_root, tmp_path, engines, options):
    _, Session = ledger
    job_id, outcome = run_with_a_quick_request_first(Session, data_root, tmp_path, engines, options, 3, cancel)
    assert outcome == "cancelled"
    rows = {r["id"]: r for r in read_results(JobPaths(data_root, job_id).results_dir).to_pylist()}
    assert rows["quick"]["finish_reason"] == "length"
    assert {rows[f"long{i}"]["finish_reason"] for i in range(3)} == {"cancelled"}
    with Session() as s:
        job = get_job(s, job_id)
        assert (job.status, job.completed_requests, job.failed_requests) == ("cancelled", 1, 0)
        assert [sh.status for sh in get_shards(s, job_id)] == ["cancelled"]


def test_a_lost_lease_stops_without_committing(ledger, data_root, tmp_path, engines, options):
    _, Session = ledger
    job_id, outcome = run_with_a_quick_request_first(Session, data_root, tmp_path, engines, options, 2,
                                                     another_worker_takes_over, lease_s=0.3)
    assert outcome == "lost"
    jp = JobPaths(data_root, job_id)
    assert not jp.result_shard(0).exists() and not list(jp.tmp_dir.glob("*"))
    with Session() as s:
        (shard,) = get_shards(s, job_id)
        assert (shard.status, shard.attempt) == ("running", 2)


def test_settings_the_engine_rejects_become_error_rows(ledger, data_root, engines, options):
    _, Session = ledger
    job_id = new_job_id()
    jp = JobPaths(data_root, job_id)
    base = {"line": 1, "prompt": "Hi", "messages": None, "max_tokens": 2, "temperature": 0.0, "top_p": 1.0,
            "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "seed": None, "stop": [], "ignore_eos": False}
    jp.input_dir.mkdir(parents=True)
    (jp.input_dir / shard_file_name(0)).write_text(
        json.dumps({**base, "id": "good"}) + "\n" + json.dumps({**base, "id": "bad", "top_p": 0.0}) + "\n")
    with Session() as s:
        create_job(s, job_id=job_id, model="tiny", engine_options=options, input_format="pipeline", endpoint=None,
                   input_path="in.jsonl", results_path=str(jp.results_dir), shard_size=2, shard_sizes=[2])
    assert run_shard(Session, data_root, job_id, 0, engine_provider=engines.use, worker_name="t") == "completed"
    rows = {r["id"]: r for r in read_results(jp.results_dir).to_pylist()}
    assert rows["bad"]["finish_reason"] == "error" and "top_p" in rows["bad"]["error"]
    assert rows["good"]["finish_reason"] in ("stop", "length")
    with Session() as s:
        job = get_job(s, job_id)
        assert (job.status, job.completed_requests, job.failed_requests) == ("completed", 1, 1)


def test_a_crash_is_retried_then_fails_the_shard_on_the_last_attempt(ledger, data_root, tmp_path, engines):
    _, Session = ledger
    rows = [{"id": f"r{i}", "prompt": "Hi", "max_tokens": 2} for i in range(3)]
    job_id = submit(Session, data_root, tmp_path, rows, {"model": str(tmp_path / "missing-model")})
    run = dict(engine_provider=engines.use, worker_name="t", max_attempts=2)
    with pytest.raises(Exception):
        run_shard(Session, data_root, job_id, 0, **run)
    with Session() as s:  # the shard is still leased to the crashed attempt
        assert [(sh.status, sh.attempt) for sh in get_shards(s, job_id)] == [("running", 1)]
        assert run_shard(Session, data_root, job_id, 0, **run) == "busy"
        s.execute(update(Shard).where(Shard.job_id == job_id)
                  .values(lease_expires_at=datetime.now(timezone.utc) - timedelta(seconds=1)))
        s.commit()
    assert run_shard(Session, data_root, job_id, 0, **run) == "failed"
    table = read_results(JobPaths(data_root, job_id).results_dir)
    assert set(table["finish_reason"].to_pylist()) == {"error"} and table.num_rows == 3
    assert "failed 2 times" in table["error"][0].as_py()
    with Session() as s:
        job = get_job(s, job_id)
        assert (job.status, job.completed_requests, job.failed_requests) == ("completed", 0, 3)
        assert run_shard(Session, data_root, job_id, 0, **run) == "skipped"
