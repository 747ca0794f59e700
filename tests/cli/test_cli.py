"""The `pipeline` CLI in-process (click's CliRunner) on a real SQLite ledger and the tiny model:
`run` end to end, `status`, `cancel`, `retry`, and a job that cannot run (a model that does
not load, a full disk, the broker down). Exports: test_export.py; engine options through a
job: test_engine_options.py; input and arguments refused: test_bad_input.py."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections import Counter

import pytest
from openai.types import Batch

from jobs.ledger import get_job, get_shards, list_jobs
from jobs.paths import JobPaths
from jobs.results.parquet_files import read_results
from jobs.submission import create_job_from_file
from cli import main
from cli_helpers import FAST, requests
from cluster import write_jsonl


def test_run_completes_with_one_row_per_request(finished_job, data_root, Session):
    job_id, result = finished_job
    assert job_id in result.stdout and "4 completed, 1 failed of 5" in result.stdout
    jp = JobPaths(data_root, job_id)
    table = read_results(jp.results_dir)
    assert sorted(table["id"].to_pylist()) == sorted(r["id"] for r in requests())
    rows = {r["id"]: r for r in table.to_pylist()}
    assert rows["too-long"]["finish_reason"] == "error" and rows["too-long"]["error"]
    assert all(r["finish_reason"] in ("stop", "length") for k, r in rows.items() if k != "too-long")
    assert {r["shard"] for r in rows.values()} == {0, 1} and {r["attempt"] for r in rows.values()} == {1}
    with Session() as s:
        job = get_job(s, job_id)
        shards = get_shards(s, job_id)
    assert (job.status, job.total_requests, job.completed_requests, job.failed_requests) == ("completed", 5, 4, 1)
    assert job.output_tokens == sum(r["output_tokens"] for r in rows.values()) > 0
    assert [sh.status for sh in shards] == ["completed", "completed"]
    assert jp.stats_file.exists() and not list(jp.tmp_dir.glob("*"))

def test_status_json_is_an_openai_batch(runner, finished_job):
    job_id, _ = finished_job
    result = runner.invoke(main, ["status", job_id, "--json"])
    assert result.exit_code == 0, result.output
    batch = Batch.model_validate(json.loads(result.stdout))
    assert (batch.id, batch.status, batch.object) == (job_id, "completed", "batch")
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (5, 4, 1)
    assert batch.pipeline["shards"] == {"completed": 2} and batch.pipeline["output_tok_s"] > 0
    listing = json.loads(runner.invoke(main, ["status", "--json"]).stdout)
    assert [Batch.model_validate(b).id for b in listing["data"]] == [job_id]
    for args in (["status", job_id], ["status"], ["list"], ["results", job_id]):
        result = runner.invoke(main, args)
        assert result.exit_code == 0 and job_id in result.stdout, (args, result.output)
    hint = f"next: 1 request(s) without an answer: `pipeline retry {job_id}` runs them again as a new job (add --local"
    assert hint in runner.invoke(main, ["status", job_id]).stdout

def test_submit_with_redis_down_exits_3_and_creates_nothing(runner, data_root, tmp_path, Session):
    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    src = write_jsonl(tmp_path / "in.jsonl", requests())
    result = runner.invoke(main, ["submit", str(src)], env={"PIPELINE_BROKER_URL": f"redis://127.0.0.1:{port}/0"})
    assert result.exit_code == 3, result.output
    assert "redis-server --daemonize yes" in result.stderr and "pipeline run" in result.stderr
    assert result.stdout == ""
    assert not (data_root / "jobs").exists()
    with Session() as s:
        assert list_jobs(s) == []

def test_cancel_a_queued_job_finishes_it_at_once(runner, data_root, tmp_path, Session):
    src = write_jsonl(tmp_path / "in.jsonl", requests())
    job_id, sizes = create_job_from_file(Session, data_root, src, model="m", engine_options={}, shard_size=2)
    assert sizes == [2, 2, 1]
    result = runner.invoke(main, ["cancel", job_id])
    assert result.exit_code == 0 and "cancelled" in result.stdout, result.output
    with Session() as s:
        assert get_job(s, job_id).status == "cancelled"
        assert {sh.status for sh in get_shards(s, job_id)} == {"cancelled"}
    assert JobPaths(data_root, job_id).stats_file.exists()
    result = runner.invoke(main, ["cancel", job_id])
    assert result.exit_code == 0, result.output  # cancelling twice is harmless


def test_status_of_a_retried_job_points_at_its_retry(runner, data_root, tmp_path, Session):
    import uuid

    from worker_process import drop_queue

    src = write_jsonl(tmp_path / "in.jsonl", requests())
    job_id, _ = create_job_from_file(Session, data_root, src, model="m", engine_options={}, shard_size=2)
    assert runner.invoke(main, ["cancel", job_id]).exit_code == 0
    before = runner.invoke(main, ["status", job_id])
    assert f"pipeline retry {job_id}" in before.stdout, before.output
    queue = f"pipeline-test-cli-{uuid.uuid4().hex[:8]}"
    try:
        retried = runner.invoke(main, ["retry", job_id], env={"PIPELINE_QUEUE": queue})
        assert retried.exit_code == 0, retried.output
        after = runner.invoke(main, ["status", job_id])
        assert f"retried as {retried.stdout.strip()}" in after.stdout and "pipeline retry" not in after.stdout
    finally:
        drop_queue(queue)


def answered_ids(data_root, job_ids):
    """Ids with a successful answer (stop or length) in each job's results, counted over all of them."""
    return Counter(r["id"] for job_id in job_ids
                   for r in read_results(JobPaths(data_root, job_id).results_dir).to_pylist()
                   if r["finish_reason"] in ("stop", "length"))


def test_retry_takes_every_unanswered_request_once(runner, data_root, tiny_model_dir, tmp_path, Session):
    """A cancelled job with one answer of each kind: retry takes the failed, cancelled and
    never run requests (--only-failed just the failed one), and never one taken before."""
    from jobs.results.finalize import finalize_job
    from jobs.ledger import claim_shard, commit_shard, request_cancel
    from jobs.results.parquet_files import write_shard_tmp

    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": f"Say {i}", "max_tokens": 2} for i in "abcdef"])
    job_id, _ = create_job_from_file(Session, data_root, src, model=str(tiny_model_dir),
                                     engine_options={"model": str(tiny_model_dir), "kv_cache_gib": 0.05},
                                     shard_size=2)
    jp = JobPaths(data_root, job_id)
    row = dict(output="x", prompt_tokens=1, output_tokens=1, cached_tokens=0, error=None, queue_s=0.0,
               ttft_s=0.1, latency_s=0.1, attempt=1)
    outcomes = {0: [("a", "stop"), ("b", "error")], 1: [("c", "length"), ("d", "cancelled")]}
    with Session() as s:
        for index in outcomes:
            assert claim_shard(s, job_id, index, "test:1", 60, 1) == 1
        assert request_cancel(s, job_id)  # shard 2 (e, f) was still queued: it never runs
        for index, rows in outcomes.items():
            write_shard_tmp([{**row, "id": i, "finish_reason": r, "shard": index} for i, r in rows],
                            jp.tmp_result(index, 1))
            assert commit_shard(s, job_id, index, 1, totals=dict(completed_requests=1, failed_requests=rows[1][1] == "error", prompt_tokens=2, output_tokens=2), tmp_path=jp.tmp_result(index, 1),
                                final_path=jp.result_shard(index), status="cancelled" if index else "completed")
    assert finalize_job(Session, data_root, job_id)

    def retry(*args):
        result = runner.invoke(main, ["retry", job_id, "--local", *args])
        assert result.exit_code == 0, result.output
        new_id = result.stdout.splitlines()[0]
        ids = [json.loads(line)["id"] for p in sorted(JobPaths(data_root, new_id).input_dir.iterdir())
               for line in p.read_text().splitlines()]
        return new_id, ids

    only_failed, ids = retry("--only-failed")
    assert ids == ["b"]
    rest, ids = retry()
    assert ids == ["d", "e", "f"]  # b was taken by the first retry
    result = runner.invoke(main, ["retry", job_id, "--local"])
    assert result.exit_code == 1 and f"retried already, as {only_failed}, {rest}" in result.stderr
    assert answered_ids(data_root, [job_id, only_failed, rest]) == Counter("abcdef")
    with Session() as s:
        assert [get_job(s, i).metadata_ for i in (only_failed, rest)] == [{"retry_of": job_id}] * 2


def test_run_with_a_model_that_cannot_load_fails_the_job(runner, data_root, tmp_path, Session):
    src = write_jsonl(tmp_path / "in.jsonl", requests(3))
    broken = tmp_path / "broken-model"   # looks like a model directory, but its files are no model
    broken.mkdir()
    (broken / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    result = runner.invoke(main, ["run", str(src), "--model", str(broken), *FAST])
    assert result.exit_code == 1 and "could not start" in result.stderr, result.output
    with Session() as s:
        (job,) = list_jobs(s)
        assert job.status == "failed" and "could not start" in job.error

@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tiny tmpfs needs root (CI runs as root)")
def test_a_full_disk_is_one_clear_line_not_a_traceback(tmp_path, tiny_model_dir):
    """`pipeline run` with its data directory on a 400 KiB filesystem that fills up."""
    disk = tmp_path / "tiny-disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(disk)], check=True)
    try:
        src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": "Hello there " * 5, "max_tokens": 2}
                                                  for i in range(600)])
        done = subprocess.run([sys.executable, "-m", "cli", "run", str(src), "--model", str(tiny_model_dir),
                               *FAST, "--shard-size", "10"], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PIPELINE_DATA_DIR": str(disk / "data")})
    finally:
        subprocess.run(["umount", str(disk)], check=True)
    assert done.returncode == 1, done.stderr
    # The disk fills under a Parquet write (the OS's ENOSPC) or a ledger write (SQLite's own words).
    assert "Traceback" not in done.stderr and "the disk failed" in done.stderr
    assert "No space left" in done.stderr or "database or disk is full" in done.stderr, done.stderr
