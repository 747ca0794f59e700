"""workers.shard_runner.run_shard with the real tiny model on SQLite and PostgreSQL:
cancellation mid-shard, a lost lease, requests the engine rejects, and exhausted attempts."""
from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import update

from jobs.ledger import Shard, create_job, get_job, get_shards
from jobs.paths import JobPaths, new_job_id
from jobs.results.parquet_files import read_results
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


def test_a_token_id_beyond_the_vocabulary_fails_its_own_request_not_another_jobs_sharing_its_steps(
        ledger, data_root, tmp_path, engines, options):
    """Two jobs' shards run at once on one engine; one line of the first names a token id the
    model has none for (as a submitter that could not read the model's config writes it:
    unchecked). That request alone gets an error row; every other, of both jobs, is answered,
    on the first and only attempt."""
    import threading

    from jobs.input.file_scan import write_input_shards
    from jobs.input.line_checks import Limits

    _, Session = ledger

    def unchecked_job(rows) -> str:
        job_id = new_job_id()
        jp = JobPaths(data_root, job_id)
        src = tmp_path / f"{job_id}.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in rows))
        _, sizes = write_input_shards(src, jp.input_dir, 100, Limits())   # no vocabulary known
        with Session() as s:
            create_job(s, job_id=job_id, model="tiny", engine_options=options, input_format="pipeline",
                       endpoint=None, input_path=str(src), results_path=str(jp.results_dir), shard_size=100,
                       shard_sizes=sizes)
        return job_id

    def good(rid):
        return {"id": rid, "prompt": f"Tell me about {rid}", "max_tokens": 24, "ignore_eos": True}

    mixed = unchecked_job([good("a0"), {"id": "bad", "prompt": [5, 6, 10**6], "max_tokens": 4}, good("a1")])
    other = unchecked_job([good(f"b{i}") for i in range(4)])
    outcomes = {}

    def run(job_id):
        outcomes[job_id] = run_shard(Session, data_root, job_id, 0, engine_provider=engines.use, worker_name="t",
                                     max_attempts=1)

    threads = [threading.Thread(target=run, args=(job_id,)) for job_id in (mixed, other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert outcomes == {mixed: "completed", other: "completed"}
    rows = {r["id"]: r for job_id in (mixed, other)
            for r in read_results(JobPaths(data_root, job_id).results_dir).to_pylist()}
    assert rows.pop("bad")["error"] == "token id 1000000 is not in the model's vocabulary (ids 0 to 49151)"
    assert {(rid, r["finish_reason"], r["output_tokens"]) for rid, r in rows.items()} == {
        (rid, "length", 24) for rid in ("a0", "a1", "b0", "b1", "b2", "b3")}
