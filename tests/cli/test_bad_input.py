"""What the CLI refuses before it makes anything: bad lines (each reported with its number),
a FIFO or a device as input, hostile ids and arguments, ids and key names the ledger cannot
store, token ids beyond the model's vocabulary, unknown jobs, models that are no model."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from jobs.ledger import list_jobs
from jobs.paths import JobPaths
from jobs.results.parquet_files import read_results
from cli import main
from cli_helpers import FAST, requests
from cluster import write_jsonl


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

@pytest.mark.parametrize("command", ["status", "results", "cancel"])
def test_unknown_job_exits_2(runner, data_root, command):
    result = runner.invoke(main, [command, "job_0123456789abcdef"])
    assert result.exit_code == 2 and "unknown job" in result.stderr

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

@pytest.mark.parametrize("value", ["0", "-3", "lots", "2.5", "AUTO "])
@pytest.mark.parametrize("command", ["run", "submit"])
def test_a_shard_size_is_auto_or_a_whole_number(runner, data_root, tmp_path, command, value):
    src = write_jsonl(tmp_path / "in.jsonl", requests(3))
    result = runner.invoke(main, [command, str(src), "--shard-size", value, *FAST])
    assert result.exit_code == 2 and 'neither "auto" nor a whole number >= 1' in result.stderr, result.output
    assert not (data_root / "jobs").exists()
    assert "[default: auto]" in runner.invoke(main, [command, "--help"]).stdout


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

# --- hostile input ----------------------------------------------------------------------------

def test_hostile_input_is_rejected_and_ids_never_become_paths(data_root, tmp_path, tiny_model_dir):
    runner = CliRunner()
    bad = write_jsonl(tmp_path / "bad.jsonl", [
        {"id": "x" * 600, "prompt": "Hi"},  # id over Limits.max_id_chars
        {"id": "deep", "prompt": "Hi", "stop": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["x"]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]},
        "{not json",
        {"id": "dup", "prompt": "Hi"}, {"id": "dup", "prompt": "Hi"},
    ])
    result = runner.invoke(main, ["run", str(bad), "--model", str(tiny_model_dir)])
    assert result.exit_code == 2
    for line in ("line 1", "line 2", "line 3", "line 5"):
        assert line in result.output
    assert "nothing was submitted" in result.output and not (data_root / "jobs").exists()
    result = runner.invoke(main, ["submit", str(bad)])  # the same report before anything is queued
    assert result.exit_code == 2 and "line 3" in result.output and not (data_root / "jobs").exists()
    for command in (["status", "../../etc"], ["results", "../x"], ["cancel", "job_/../../x"], ["retry", ".."]):
        result = runner.invoke(main, command)
        assert result.exit_code == 2 and "invalid job id" in result.output, (command, result.output)
    # a request id that looks like a path is just data
    ok = write_jsonl(tmp_path / "ok.jsonl", [{"id": "../../etc/passwd", "prompt": "Hi", "max_tokens": 2}])
    result = runner.invoke(main, ["run", str(ok), "--model", str(tiny_model_dir), "--kv-cache-gib", "0.05",
                                  "--device", "cpu"])
    assert result.exit_code == 0, result.output
    files = {p.relative_to(data_root).as_posix() for p in data_root.rglob("*") if p.is_file()}
    assert all(f.startswith("jobs/job_") or f.startswith("ledger.sqlite") for f in files), files
    (job_dir,) = (data_root / "jobs").iterdir()
    assert read_results(job_dir / "results")["id"].to_pylist() == ["../../etc/passwd"]
