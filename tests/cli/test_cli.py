"""The `pipeline` CLI in-process (click's CliRunner) on a real SQLite ledger and the tiny model."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
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
from cluster import TOO_LONG_FOR_TINY
import hold

FAST = ["--kv-cache-gib", "0.05", "--device", "cpu"]


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def requests(n=5):
    """n small requests mixing prompts and chat messages, and one far too long for the tiny model."""
    rows = [{"id": f"r{i}", "prompt": f"Tell me about {i}", "max_tokens": 4, "temperature": 0} for i in range(n - 2)]
    rows.append({"id": "chat", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "seed": 7})
    rows.append({"id": "too-long", "prompt": TOO_LONG_FOR_TINY, "max_tokens": 2})  # over the context
    return rows


@pytest.fixture
def finished_job(runner, data_root, tiny_model_dir, tmp_path, Session):
    """A job run to the end by `pipeline run` (5 requests, one of them failing, 2 shards)."""
    src = write_jsonl(tmp_path / "in.jsonl", requests())
    result = runner.invoke(main, ["run", str(src), "--model", str(tiny_model_dir), "--shard-size", "3", *FAST])
    assert result.exit_code == 0, result.output
    with Session() as s:
        (job,) = list_jobs(s)
    return job.id, result


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


def test_chat_job_with_a_long_system_prompt_computes_it_once(runner, data_root, tiny_model_dir, tmp_path, Session):
    system = "You are a careful assistant who answers in one short sentence. " * 8
    src = write_jsonl(tmp_path / "chat.jsonl", [
        {"id": f"q{i}", "messages": [{"role": "system", "content": system},
                                     {"role": "user", "content": f"What is {i} + {i}?"}],
         "max_tokens": 6, "temperature": 0} for i in range(6)])
    for flag in ("--prefix-caching", "--no-prefix-caching"):
        result = runner.invoke(main, ["run", str(src), "--model", str(tiny_model_dir), "--shard-size", "3",
                                      flag, "--no-reuse", *FAST])   # both computed: the prefix cache is measured
        assert result.exit_code == 0, result.output
    with Session() as s:
        plain, cached = list_jobs(s)                      # newest first
    assert cached.engine_options.get("enable_prefix_caching") is True
    assert plain.engine_options["enable_prefix_caching"] is False
    rows = {job.id: {r["id"]: r for r in read_results(JobPaths(data_root, job.id).results_dir).to_pylist()}
            for job in (cached, plain)}
    assert {k: r["output"] for k, r in rows[cached.id].items()} == {k: r["output"] for k, r in rows[plain.id].items()}
    hits = [rows[cached.id][f"q{i}"]["cached_tokens"] for i in range(6)]
    # The first request computes the system prompt; every later one (the second shard too:
    # one engine serves the whole run) finds its full blocks in the cache.
    assert hits[0] == 0 and hits[1] >= 64 and hits[1] % 16 == 0 and set(hits[1:]) == {hits[1]}
    assert all(r["cached_tokens"] == 0 for r in rows[plain.id].values())
    prompt_tokens = sum(r["prompt_tokens"] for r in rows[cached.id].values())
    assert (cached.cached_tokens, plain.cached_tokens) == (sum(hits), 0)
    assert cached.prefix_hit_rate == pytest.approx(sum(hits) / prompt_tokens)
    assert plain.prefix_hit_rate == 0


def test_bad_file_reports_every_line_and_creates_nothing(runner, data_root, tmp_path, Session):
    src = write_jsonl(tmp_path / "bad.jsonl", [
        {"id": "a", "prompt": "ok"},
        "{not json",
        {"id": "a", "prompt": "duplicate id"},
        {"id": "b", "prompt": "x", "temperature": -1},
        {"id": "c"},
        "[1, 2]",
        {"id": "d", "prompt": "x", "colour": "blue"},
    ])
    result = runner.invoke(main, ["run", str(src), *FAST])
    assert result.exit_code == 2, result.output
    for line in (2, 3, 4, 5, 6, 7):
        assert f"line {line}:" in result.stderr
    assert "line 1:" not in result.stderr and "6 error(s)" in result.stderr
    assert not (data_root / "jobs").exists()
    with Session() as s:
        assert list_jobs(s) == []


def test_a_fifo_or_a_device_is_refused_at_once_and_stdin_is_read_once(runner, data_root, tiny_model_dir, tmp_path,
                                                                     Session):
    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)  # nobody ever writes to it: a reader that opened it would wait for ever
    env = {**os.environ, "PIPELINE_DATA_DIR": str(data_root)}
    for command, path in (("run", fifo), ("submit", fifo), ("run", "/dev/zero"), ("bench", fifo)):
        done = subprocess.run([sys.executable, "-m", "cli", command, str(path)], env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, (command, path, done.stderr)
        kind = "a FIFO (named pipe)" if path == fifo else "a character device"
        assert f"is {kind}, not a regular file" in done.stderr and "Traceback" not in done.stderr
    assert not (data_root / "jobs").exists()
    # Standard input is read once, into the job's own copy, and runs like a file.
    rows = requests()
    text = "".join(json.dumps(r) + "\n" for r in rows)
    result = runner.invoke(main, ["run", "-", "--model", str(tiny_model_dir), *FAST], input=text)
    assert result.exit_code == 0, result.output
    with Session() as s:
        (job,) = list_jobs(s)
    copy = JobPaths(data_root, job.id).stdin_copy
    assert job.input_path == str(copy) and copy.read_text() == text
    ids = read_results(JobPaths(data_root, job.id).results_dir)["id"].to_pylist()
    assert sorted(ids) == sorted(r["id"] for r in rows)
    result = runner.invoke(main, ["run", "-", *FAST], input='{"prompt": "ok"}\n{"role": "wizard"}\n')
    assert result.exit_code == 2 and "standard input: 1 error(s), nothing was submitted" in result.stderr
    assert "line 2:" in result.stderr and [p.name for p in (data_root / "jobs").iterdir()] == [job.id]


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


def test_results_export(runner, finished_job, tmp_path):
    job_id, _ = finished_job
    out = tmp_path / "out.jsonl"
    result = runner.invoke(main, ["results", job_id, "--export", str(out)])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == sorted(r["id"] for r in requests())
    result = runner.invoke(main, ["results", job_id, "--format", "openai", "--output-file", str(tmp_path / "ok.jsonl"),
                                  "--error-file", str(tmp_path / "err.jsonl")])
    assert result.exit_code == 0, result.output
    ok = [json.loads(line)["custom_id"] for line in (tmp_path / "ok.jsonl").read_text().splitlines()]
    err = [json.loads(line)["custom_id"] for line in (tmp_path / "err.jsonl").read_text().splitlines()]
    assert len(ok) == 4 and err == ["too-long"]


def export(runner, job_id, *args):
    return runner.invoke(main, ["results", job_id, *map(str, args)])


def exported_ids(path):
    return sorted(json.loads(line).get("custom_id") or json.loads(line)["id"] for line in path.read_text().splitlines())


def test_export_makes_missing_directories_and_reports_unwritable_ones(runner, finished_job, tmp_path):
    job_id, _ = finished_job
    out = tmp_path / "new" / "dir" / "out.jsonl"
    assert export(runner, job_id, "--export", out).exit_code == 0
    assert exported_ids(out) == sorted(r["id"] for r in requests())
    ok = tmp_path / "other" / "ok.jsonl"
    assert export(runner, job_id, "--format", "openai", "--output-file", ok).exit_code == 0
    assert len(exported_ids(ok)) == 4 and exported_ids(ok.with_name("ok.errors.jsonl")) == ["too-long"]
    (tmp_path / "a-file").write_text("")
    result = export(runner, job_id, "--export", tmp_path / "a-file" / "out.jsonl")
    assert result.exit_code == 1 and "the export could not be written" in result.stderr, result.output
    assert isinstance(result.exception, SystemExit)  # a clear error, not a traceback


def test_export_never_follows_a_planted_link_nor_replaces_a_device(runner, finished_job, tmp_path):
    job_id, _ = finished_job
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out.jsonl"
    planted = [tmp_path / ".out.jsonl.tmp", tmp_path / "out.jsonl.tmp"]  # the names a fixed temp file had
    for link in planted:
        link.symlink_to(victim)
    assert export(runner, job_id, "--export", out).exit_code == 0
    assert victim.read_text() == "precious" and all(link.is_symlink() for link in planted)
    assert exported_ids(out) == sorted(r["id"] for r in requests())
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")) == sorted(p.name for p in planted)
    # A target that is not a regular file is refused, with or without --force.
    fifo = tmp_path / "target.fifo"
    os.mkfifo(fifo)
    link = tmp_path / "link.jsonl"
    link.symlink_to(victim)
    targets = [(fifo, "a FIFO (named pipe)"), (link, "a symbolic link")]
    with contextlib.suppress(PermissionError):  # a character device like /dev/full, where root may make one
        os.mknod(tmp_path / "full", 0o666 | stat.S_IFCHR, os.makedev(1, 7))
        targets.append((tmp_path / "full", "a character device"))
    for target, kind in targets:
        for force in ([], ["--force"]):
            result = export(runner, job_id, "--export", target, *force)
            assert result.exit_code == 2 and f"is {kind}, not a regular file" in result.stderr, result.output
            result = export(runner, job_id, "--format", "openai", "--output-file", tmp_path / "ok.jsonl",
                            "--error-file", target, *force)
            assert result.exit_code == 2 and "nothing was written" in result.stderr, result.output
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and link.is_symlink() and victim.read_text() == "precious"
    assert not (tmp_path / "ok.jsonl").exists()  # refused up front: not even the output file


def test_export_refuses_one_file_for_output_and_errors(runner, finished_job, tmp_path):
    job_id, _ = finished_job
    tmp_path = tmp_path / "exports"
    (tmp_path / "d").mkdir(parents=True)
    for out, err in ((tmp_path / "x.jsonl", tmp_path / "x.jsonl"),
                     (tmp_path / "d" / ".." / "x.jsonl", tmp_path / "x.jsonl")):
        result = export(runner, job_id, "--format", "openai", "--output-file", out, "--error-file", err)
        assert result.exit_code == 2 and "are the same file" in result.stderr, result.output
    result = export(runner, job_id, "--format", "openai", "--export", tmp_path / "x.jsonl",
                    "--error-file", tmp_path / "x.jsonl", "--force")
    assert result.exit_code == 2 and "are the same file" in result.stderr
    result = export(runner, job_id, "--export", tmp_path / "x.jsonl", "--error-file", tmp_path / "e.jsonl")
    assert result.exit_code == 2 and "--error-file is for --format openai" in result.stderr  # not silently ignored
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_export_replaces_an_existing_file_only_with_force(runner, finished_job, tmp_path):
    job_id, _ = finished_job
    out, ok, err = tmp_path / "out.jsonl", tmp_path / "ok.jsonl", tmp_path / "err.jsonl"
    for path in (out, err):
        path.write_text("old\n")
    openai = ["--format", "openai", "--output-file", ok, "--error-file", err]
    for args in (["--export", out], openai):
        result = export(runner, job_id, *args)
        assert result.exit_code == 2 and "already exists: nothing was written (add --force" in result.stderr
    assert out.read_text() == err.read_text() == "old\n" and not ok.exists()
    assert export(runner, job_id, "--export", out, "--force").exit_code == 0
    assert export(runner, job_id, *openai, "--force").exit_code == 0
    assert exported_ids(out) == sorted(r["id"] for r in requests()) and exported_ids(err) == ["too-long"]
    assert "--force" in runner.invoke(main, ["results", "--help"]).stdout


@pytest.mark.parametrize("command", ["status", "results", "cancel"])
def test_unknown_job_exits_2(runner, data_root, command):
    result = runner.invoke(main, [command, "job_0123456789abcdef"])
    assert result.exit_code == 2 and "unknown job" in result.stderr


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


@pytest.mark.parametrize("command", ["submit", "run"])
def test_a_model_that_is_no_model_directory_is_refused_before_anything_is_made(runner, data_root, tmp_path,
                                                                              Session, command):
    src = write_jsonl(tmp_path / "in.jsonl", requests(3))
    not_a_model = tmp_path / "just-a-dir"
    not_a_model.mkdir()
    for model, says in ((tmp_path / "no-such-model", "no such directory"), (not_a_model, "no config.json")):
        result = runner.invoke(main, [command, str(src), "--model", str(model), *FAST])
        assert result.exit_code == 2 and says in result.stderr, result.output
    assert not (data_root / "jobs").exists()
    with Session() as s:
        assert list_jobs(s) == []


@pytest.mark.parametrize("value", ["nan", "inf", "1e400", "-1", "0"])
def test_a_request_timeout_must_be_a_finite_positive_number(runner, data_root, tmp_path, value):
    src = write_jsonl(tmp_path / "in.jsonl", requests(3))
    result = runner.invoke(main, ["run", str(src), "--request-timeout", value, *FAST])
    assert result.exit_code == 2 and "--request-timeout" in result.stderr, result.output
    assert not (data_root / "jobs").exists()


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


def test_request_timeouts_end_long_requests_as_failed_rows_keeping_their_text(runner, data_root, tiny_model_dir,
                                                                             tmp_path, Session):
    """--request-timeout for the job, timeout_s on a line winning over it: the long requests
    end `timeout` with what they had generated, count as failed, and `retry --only-failed`
    would take them; the short ones answer normally. A bad timeout_s names its line. The
    engine holds the long ones four tokens in until both are past their timeouts
    (tests/hold.py), so they cannot finish first on a fast machine, as they did unheld."""
    rows = [{"id": "long-job-timeout", "prompt": "Count", "max_tokens": 400, "ignore_eos": True},
            {"id": "long-own-timeout", "prompt": "Count", "max_tokens": 400, "ignore_eos": True, "timeout_s": 0.1},
            {"id": "short", "prompt": "Hi", "max_tokens": 3, "timeout_s": 600}]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    def group(request_id):
        return "long" if request_id.startswith("long-") else request_id

    with hold.installed(prefix="long-", group=group):
        result = runner.invoke(main, ["run", str(src), "--model", str(tiny_model_dir), "--request-timeout", "0.3",
                                      *FAST])
    assert result.exit_code == 0, result.output   # the job ran to the end
    assert "held: long-" in result.output   # they were held before their timeouts
    with Session() as s:
        (job,) = list_jobs(s)
    table = {r["id"]: r for r in read_results(JobPaths(data_root, job.id).results_dir).to_pylist()}
    for rid, after in (("long-job-timeout", "0.3"), ("long-own-timeout", "0.1")):
        row = table[rid]
        assert row["finish_reason"] == "timeout" and row["error"] == f"timed out after {after} s"
        assert 1 <= row["output_tokens"] < 400 and row["output"]
    assert table["short"]["finish_reason"] == "length"
    assert (job.completed_requests, job.failed_requests, job.request_timeout_s) == (1, 2, 0.3)

    bad = write_jsonl(tmp_path / "bad.jsonl", [rows[2], {**rows[2], "id": "x", "timeout_s": -1}])
    refused = runner.invoke(main, ["run", str(bad), "--model", str(tiny_model_dir), *FAST])
    assert refused.exit_code == 2 and "line 2: timeout_s must be a number > 0" in refused.stderr, refused.output


def test_bench_with_an_int8_kv_cache_reports_blocks_and_peak_use(runner, data_root, tiny_model_dir, tmp_path):
    """--kv-cache-dtype is an engine option of every command; bench's JSON line keeps its
    keys and adds the pool's size and its peak use."""
    src = write_jsonl(tmp_path / "w.jsonl", [{"id": str(i), "prompt": f"Count to {i}:", "max_tokens": 4,
                                              "temperature": 0, "ignore_eos": True} for i in range(3)])
    for command in ("run", "submit", "bench"):
        assert "--kv-cache-dtype [auto|int8]" in runner.invoke(main, [command, "--help"]).output, command
    lines = {}
    for kv in ("auto", "int8"):
        result = runner.invoke(main, ["bench", str(src), "--model", str(tiny_model_dir), "--kv-cache-dtype", kv, *FAST])
        assert result.exit_code == 0, result.output
        lines[kv] = json.loads(result.output.strip().splitlines()[-1])
    openai_line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Hi"}}
    refused = runner.invoke(main, ["bench", str(write_jsonl(tmp_path / "openai.jsonl", [openai_line])), *FAST])
    assert refused.exit_code == 2 and 'line 1: no "prompt": bench reads the lines' in refused.output, refused.output
    auto, int8 = lines["auto"], lines["int8"]
    assert {"engine", "requests", "output_tokens", "output_tok_s", "total_tok_s", "prefix_hit_rate"} <= set(int8)
    assert int8["output_tokens"] == auto["output_tokens"] == 12
    assert int8["kv_blocks"] >= 3 * auto["kv_blocks"] > 0      # float32 here: 4 bytes -> 1 + a scale
    assert 0 < int8["kv_peak_utilization"] < auto["kv_peak_utilization"] <= 1


def test_speculative_run_records_drafts_in_results_and_stats(runner, data_root, tmp_path, Session):
    """--speculative ngram through a whole job: the same outputs as without, and the
    drafted/accepted counts in the results Parquet and the job's stats file."""
    import pyarrow.parquet as pq
    text = "Record {}: Alice Moreau, Lyon, 63 units of rubber seals, status partial."
    src = write_jsonl(tmp_path / "copy.jsonl", [  # the bundled model copies; the tiny random one would not
        {"id": f"c{i}", "prompt": f"Text:\n{text.format(i)}\n\nThe same text, copied exactly:\nRecord",
         "max_tokens": 12, "temperature": 0} for i in range(3)])
    outputs = {}
    for flags in ([], ["--speculative", "ngram", "--num-speculative-tokens", "3"]):
        result = runner.invoke(main, ["run", str(src), "--dtype", "float32", *flags, *FAST])
        assert result.exit_code == 0, result.output
        with Session() as s:
            job = list_jobs(s)[0]
        jp = JobPaths(data_root, job.id)
        outputs[bool(flags)] = {r["id"]: r for r in read_results(jp.results_dir).to_pylist()}
        stats = pq.read_table(jp.stats_file).to_pylist()[0]
    plain, spec = outputs[False], outputs[True]
    assert {k: r["output"] for k, r in spec.items()} == {k: r["output"] for k, r in plain.items()}
    assert all(r["draft_tokens"] == r["accepted_tokens"] == 0 for r in plain.values())
    drafted = sum(r["draft_tokens"] for r in spec.values())
    assert drafted > 0 and all(0 <= r["accepted_tokens"] <= r["draft_tokens"] for r in spec.values())
    assert stats["draft_tokens"] == drafted
    assert stats["acceptance_rate"] == pytest.approx(sum(r["accepted_tokens"] for r in spec.values()) / drafted)
    assert (job.draft_tokens, job.acceptance_rate) == (drafted, pytest.approx(stats["acceptance_rate"]))


def test_overlapped_steps_through_a_job_give_the_same_answers(runner, data_root, tiny_model_dir, tmp_path, Session):
    """--overlap-steps (the CUDA default) reaches the engine through `pipeline run`: the same
    greedy outputs, stop strings and lengths as serial steps."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": f"Item {i}: the", "max_tokens": 4 + 3 * i,
                                               "temperature": 0, **({"stop": ["e"]} if i % 2 else {})}
                                              for i in range(6)])
    outputs = []
    for flags in ([], ["--overlap-steps"]):
        result = runner.invoke(main, ["run", str(src), "--model", str(tiny_model_dir), *flags, *FAST])
        assert result.exit_code == 0, result.output
        with Session() as s:
            job = list_jobs(s)[0]
        assert job.engine_options.get("overlap_steps") is (True if flags else None)   # recorded as asked
        rows = read_results(JobPaths(data_root, job.id).results_dir).to_pylist()
        outputs.append({r["id"]: (r["output"], r["finish_reason"], r["output_tokens"]) for r in rows})
    assert len(outputs[1]) == 6 and outputs[1] == outputs[0]
    bench = {}
    for flags in ([], ["--overlap-steps"]):   # bench counts its steps, and those overlapped
        result = runner.invoke(main, ["bench", str(src), "--model", str(tiny_model_dir), *flags, *FAST])
        assert result.exit_code == 0, result.output
        bench[bool(flags)] = json.loads(result.output.strip().splitlines()[-1])
    assert bench[False]["overlapped_steps"] == 0 < bench[False]["steps"]
    assert 0 < bench[True]["overlapped_steps"] < bench[True]["steps"]


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


def test_ids_the_ledger_cannot_store_are_line_errors_at_submit(runner, db_url, data_root, tmp_path):
    """A NUL in an id (PostgreSQL's text cannot hold one: every commit of its shard failed) or a
    lone surrogate: that line's error, on either ledger; a NUL in a prompt goes to Parquet: fine."""
    from jobs.ledger import make_engine, session_factory
    from worker_process import BROKER_URL, drop_queue

    queue = f"pipeline-test-ids-{os.urandom(4).hex()}"
    env = {"PIPELINE_DATABASE_URL": db_url, "PIPELINE_BROKER_URL": BROKER_URL, "PIPELINE_QUEUE": queue}
    pipeline_lines = write_jsonl(tmp_path / "pipeline.jsonl", [
        '{"id": "fine", "prompt": "a NUL \\u0000 in a prompt is fine"}',
        '{"id": "nul\\u0000x", "prompt": "Hi"}',
        '{"id": "\\ud800", "prompt": "Hi"}'])
    openai_lines = write_jsonl(tmp_path / "openai.jsonl", [
        {"custom_id": "fine", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Hi"}},
        '{"custom_id": "nul\\u0000x", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Hi"}}'])
    try:
        result = runner.invoke(main, ["submit", str(pipeline_lines), *FAST], env=env)
        assert result.exit_code == 2, result.output
        assert "2 error(s)" in result.stderr and "line 1:" not in result.stderr
        assert "line 2: id contains a NUL character (\\u0000)" in result.stderr
        assert "line 3: id contains an unpaired surrogate '\\ud800'" in result.stderr
        result = runner.invoke(main, ["submit", str(openai_lines), *FAST], env=env)
        assert result.exit_code == 2 and "line 2: custom_id contains a NUL" in result.stderr, result.output
    finally:
        drop_queue(queue)
    engine = make_engine(db_url)
    with session_factory(engine)() as s:
        assert list_jobs(s) == []
    engine.dispose()


@pytest.mark.parametrize("age", ["99999999d", "999999999999d", "999999999999h", "36501d"])
def test_gc_refuses_an_age_too_large_as_bad_usage(runner, data_root, age):
    result = runner.invoke(main, ["gc", "--older-than", age])
    assert result.exit_code == 2 and "an age is at most 36500d" in result.stderr, result.output
    assert isinstance(result.exception, SystemExit)   # a usage error, not an OverflowError
    assert runner.invoke(main, ["gc", "--older-than", "36500d"]).exit_code == 0


def test_key_names_the_ledger_cannot_store_are_bad_usage(runner, db_url, data_root):
    """A name given in bytes that are not UTF-8 reaches Python as a lone surrogate: `keys revoke`
    raised the driver's UnicodeEncodeError (a traceback, exit 1) on either ledger."""
    env = {"PIPELINE_DATABASE_URL": db_url}
    for command in (["keys", "add", "team-\udcff"], ["keys", "revoke", "team-\udcff"]):
        result = runner.invoke(main, command, env=env)
        assert result.exit_code == 2 and "unpaired surrogate" in result.stderr, result.output
        assert isinstance(result.exception, SystemExit)
    assert runner.invoke(main, ["keys", "add", "team-é"], env=env).exit_code == 0
    assert "team-é" in runner.invoke(main, ["keys", "list"], env=env).stdout


def test_token_ids_beyond_the_models_vocabulary_are_refused_at_submit_with_their_lines(runner, data_root, tmp_path,
                                                                                     tiny_model_dir):
    """The model's vocabulary (its config's vocab_size, 49152 for the tiny model) bounds every
    token id at submit: a prompt's, an embedding input's, a logit_bias key's."""
    src = write_jsonl(tmp_path / "ids.jsonl", [
        {"id": "ok", "prompt": [1, 2, 49151], "max_tokens": 2},
        {"id": "prompt", "prompt": [1, 49152], "max_tokens": 2},
        {"id": "bias", "prompt": "Hi", "logit_bias": {"70000": 5}, "max_tokens": 2}])
    done = runner.invoke(main, ["run", str(src), "--model", str(tiny_model_dir), *FAST])
    assert done.exit_code == 2, done.output
    assert "line 2: prompt holds token id 49152; the model's vocabulary has ids 0 to 49151" in done.stderr
    assert "line 3: logit_bias names token id 70000" in done.stderr and "line 1" not in done.stderr
    assert not (data_root / "jobs").exists() or not any((data_root / "jobs").iterdir())   # nothing was made
