"""A job's failed or unanswered requests run again: a shard that always kills its worker
fails after its attempts, a job cancelled mid-shard keeps what finished, and `pipeline
retry` (through workers, or --local) then runs exactly the requests without an answer,
each once. Real Celery workers (subprocesses) on real Redis with the tiny model."""
from __future__ import annotations

import json
import signal
from collections import Counter

import pyarrow.dataset as pads
from click.testing import CliRunner

from jobs.ledger import ensure_schema, get_job, job_counts, list_jobs, make_engine, session_factory
from jobs.paths import JobPaths, check_job_id, default_database_url
from jobs.results.parquet_files import read_results
from jobs.submission import create_job_from_file
from cli import main
from cluster import TINY_CONTEXT, TOO_LONG_FOR_TINY, long_rows, quick_then_held, write_jsonl


# --- a shard that always kills its worker, then `pipeline retry` -------------------------------

def test_a_shard_that_always_crashes_its_worker_fails_then_retry_completes_it(sqlite_url, cluster_factory):
    c = cluster_factory(sqlite_url, PIPELINE_MAX_ATTEMPTS=2)
    rows = long_rows("ok", 2, 60) + long_rows("crash-", 2, 60) + long_rows("ok", 4, 60)[2:]
    # a prefork worker: the pool replaces each child that dies, the parent's recovery thread reaps
    crasher = c.start_worker(app="tests.crashing_worker", pool="prefork")
    job_id = c.submit(rows, shard_size=2)
    job = c.wait_until_ended(job_id)
    assert job.status == "completed" and (job.completed_requests, job.failed_requests) == (4, 2)
    table = c.assert_exactly_once(job_id, [r["id"] for r in rows])
    by_id = {r["id"]: r for r in table.to_pylist()}
    assert {i for i, r in by_id.items() if r["finish_reason"] == "error"} == {"crash-000", "crash-001"}
    assert all("2 attempts" in by_id[i]["error"] for i in ("crash-000", "crash-001"))
    shards = c.shards(job_id)
    assert [sh.status for sh in shards] == ["completed", "failed", "completed"]
    assert (shards[1].attempt, shards[1].failed_requests) == (2, 2)
    assert crasher.poll() is None  # the pool survived its children's deaths
    assert c.log(crasher).count("WorkerLostError") >= 2

    # `pipeline retry` queues exactly the failed requests as a new job; a sound worker runs them
    crasher.terminate()
    crasher.wait(timeout=60)
    c.start_worker()
    done = c.cli("retry", job_id, "--wait")
    assert done.returncode == 0, done.stderr + c.all_logs()
    retry_id = check_job_id(done.stdout.strip())
    retry = c.job(retry_id)
    assert retry.status == "completed" and retry.metadata_ == {"retry_of": job_id}
    assert (retry.total_requests, retry.completed_requests, retry.failed_requests) == (2, 2, 0)
    retried = c.assert_exactly_once(retry_id, ["crash-000", "crash-001"])
    assert set(retried["finish_reason"].to_pylist()) <= {"stop", "length"}
    assert c.job(job_id).status == "completed"  # the old job is left as it was


def test_retry_local_runs_only_the_failed_requests_again(data_root, tiny_model_dir, tmp_path):
    """Requests that fail for a reason of their own (a prompt longer than the model's
    context) fail again; the retry job holds exactly them, with the same parameters."""
    url = default_database_url(data_root)
    ensure_schema(url)
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "fine", "prompt": "Hi", "max_tokens": 3},
        {"id": "long-1", "prompt": TOO_LONG_FOR_TINY, "max_tokens": 2, "temperature": 0.5, "seed": 3},
        {"id": "fine-2", "prompt": "Hello", "max_tokens": 3},
        {"id": "long-2", "prompt": "more " * (TINY_CONTEXT + 200), "max_tokens": 4},
    ])
    runner = CliRunner()
    model = ["--model", str(tiny_model_dir), "--kv-cache-gib", "0.05", "--device", "cpu"]
    assert runner.invoke(main, ["run", str(src), *model, "--shard-size", "3"]).exit_code == 0
    engine = make_engine(url)
    Session = session_factory(engine)
    try:
        with Session() as s:
            (old,) = list_jobs(s)
        result = runner.invoke(main, ["retry", old.id, "--local"])
        assert result.exit_code == 0, result.output  # the retry job completes; its requests fail again
        new_id = check_job_id(result.stdout.splitlines()[0])
        with Session() as s:
            new = get_job(s, new_id)
        assert new.metadata_ == {"retry_of": old.id} and new.engine_options == old.engine_options
        assert (new.status, new.total_requests, new.failed_requests) == ("completed", 2, 2)
        rows = {r["id"]: r for r in read_results(JobPaths(data_root, new_id).results_dir).to_pylist()}
        assert set(rows) == {"long-1", "long-2"} and {r["finish_reason"] for r in rows.values()} == {"error"}
        old_lines = [json.loads(x) for p in sorted(JobPaths(data_root, old.id).input_dir.glob("*.jsonl"))
                     for x in p.read_text().splitlines()]
        new_lines = [json.loads(x) for p in sorted(JobPaths(data_root, new_id).input_dir.glob("*.jsonl"))
                     for x in p.read_text().splitlines()]
        assert new_lines == [d for d in old_lines if d["id"].startswith("long")]  # same normalised requests
        # a job that has not ended cannot be retried; one without failures has nothing to retry
        pending = create_job_from_file(Session, data_root, write_jsonl(tmp_path / "ok.jsonl", [
            {"id": "a", "prompt": "Hi", "max_tokens": 1}]), model="tiny", engine_options={}, shard_size=1)[0]
        result = runner.invoke(main, ["retry", pending, "--local"])
        assert result.exit_code == 2 and "only an ended job" in result.output
        result = runner.invoke(main, ["retry", new_id, "--local"])  # its two requests failed again: retryable
        assert result.exit_code == 0
        result = runner.invoke(main, ["run", str(tmp_path / "ok.jsonl"), *model])
        with Session() as s:
            clean = list_jobs(s)[0].id
        result = runner.invoke(main, ["retry", clean, "--local"])
        assert result.exit_code == 1 and "nothing to retry" in result.output
        assert runner.invoke(main, ["retry", "job_../../etc"]).exit_code == 2
    finally:
        engine.dispose()

# --- cancel mid-job ---------------------------------------------------------------------------

def test_cancel_mid_job_stops_the_worker_promptly_then_retry_runs_the_rest(sqlite_url, cluster_factory):
    """One shard in flight: shard 0 completes, shard 1 is cancelled mid-generation, shard 2
    never runs; `pipeline retry --wait` then runs every request without an answer once."""
    c = cluster_factory(sqlite_url)
    rows = quick_then_held(4, 8)
    # Held with shard 1 four tokens in until the cancel reaches it: the job can end only if
    # the shard saw the cancel at a step (its hold ends when its stream stops), however
    # fast or slow the machine, and none of its requests can have finished.
    w = c.start_worker(held=True, PIPELINE_SHARDS_IN_FLIGHT=1)
    job_id = c.submit(rows, shard_size=4)
    c.wait_held(w)
    assert [sh.status for sh in c.shards(job_id)] == ["completed", "running", "queued"]
    done = c.cli("cancel", job_id)
    assert done.returncode == 0 and job_id in done.stdout, done.stderr
    job = c.wait_until_ended(job_id)
    assert job.status == "cancelled"
    shards = c.shards(job_id)
    assert not [sh for sh in shards if sh.status in ("running", "queued")]
    assert shards[1].status == "cancelled"
    # the committed shards (and the cancelled one's partial rows) are a readable dataset
    table = pads.dataset(str(JobPaths(c.root, job_id).results_dir), format="parquet").to_table()
    counts = Counter(table["id"].to_pylist())
    assert set(counts.values()) == {1} and set(counts) <= {r["id"] for r in rows}
    reasons = Counter(table["finish_reason"].to_pylist())
    assert reasons["cancelled"] == 4 and job.completed_requests == reasons["stop"] + reasons["length"] == 4
    with c.Session() as s:
        assert job_counts(s, job_id)["completed_requests"] == job.completed_requests
    assert not list(JobPaths(c.root, job_id).tmp_dir.glob("*"))
    assert w.poll() is None  # the worker is still there for other jobs
    never_run = {r["id"] for r in rows} - set(counts)
    assert never_run and shards[-1].status == "cancelled" and reasons["cancelled"] >= 1

    # a worker without the hold runs the retry
    w.send_signal(signal.SIGTERM)
    w.wait(timeout=60)
    c.start_worker(PIPELINE_SHARDS_IN_FLIGHT=4)
    done = c.cli("retry", job_id, "--wait")
    assert done.returncode == 0, done.stderr + c.all_logs()
    retry_id = check_job_id(done.stdout.strip())
    reason = dict(zip(table["id"].to_pylist(), table["finish_reason"].to_pylist()))
    unanswered = [r["id"] for r in rows if reason.get(r["id"], "never run") in ("cancelled", "never run")]
    assert c.job(retry_id).status == "completed" and len(unanswered) == len(rows) - job.completed_requests
    c.assert_exactly_once(retry_id, unanswered)
    c.assert_answered_once([job_id, retry_id], [r["id"] for r in rows])
