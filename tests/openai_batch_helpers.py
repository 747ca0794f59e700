"""Helpers of the OpenAI Batch format tests (tests/end_to_end/test_openai_*.py): batch input
files and their twins in our own format, a job run or submitted and waited for, its rows, and
its OpenAI output and error files."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid

from jobs.paths import JobPaths, check_job_id
from jobs.results.parquet_files import read_results
from worker_process import BROKER_URL
from cli import main
from cluster import TOO_LONG_FOR_TINY, write_jsonl

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
FAST = ["--kv-cache-gib", "0.05", "--device", "cpu"]
QUEUE = f"pipeline-test-openai-{uuid.uuid4().hex[:8]}"  # these tests' own queue (each module drops it)
WAIT_S = 180
MAX_TOKENS = 16
TOO_LONG = TOO_LONG_FOR_TINY  # that request fails

# id -> chat messages; "long" fails, "mct" uses max_completion_tokens instead of max_tokens.
CHATS = {
    "greet": [{"role": "user", "content": "Hello! Who are you?"}],
    "capital": [{"role": "system", "content": "You answer in one word."},
                {"role": "user", "content": "What is the capital of France?"}],
    "mct": [{"role": "user", "content": "Count from one to five."}],
    "long": [{"role": "user", "content": TOO_LONG}],
}
PROMPTS = {
    "story": "Once upon a time",
    "list": "Three colours are",
    "long": TOO_LONG,
}
FAILING = {"long"}


# ---- input files --------------------------------------------------------------------------

def openai_line(custom_id, url, body):
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def chat_batch(path):
    rows = []
    for cid, messages in CHATS.items():
        body = {"messages": messages, "temperature": 0}  # no model: the job's
        body["max_completion_tokens" if cid == "mct" else "max_tokens"] = MAX_TOKENS
        rows.append(openai_line(cid, CHAT, body))
    return write_jsonl(path, rows)


def chat_pipeline(path):
    return write_jsonl(path, [{"id": cid, "messages": m, "max_tokens": MAX_TOKENS, "temperature": 0}
                              for cid, m in CHATS.items()])


def completions_batch(path):
    return write_jsonl(path, [openai_line(cid, COMPLETIONS, {"prompt": p, "max_tokens": MAX_TOKENS,
                                                             "temperature": 0})
                              for cid, p in PROMPTS.items()])


def completions_pipeline(path):
    return write_jsonl(path, [{"id": cid, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0}
                              for cid, p in PROMPTS.items()])


# ---- helpers --------------------------------------------------------------------------------

def run_job(runner, src, model_dir) -> str:
    """`pipeline run` on the tiny model; returns the job id it reported."""
    result = runner.invoke(main, ["run", str(src), "--model", str(model_dir), *FAST])
    assert result.exit_code == 0, result.output
    m = re.search(r"^job (job_[0-9a-f]{16}): completed$", result.stdout, re.M)
    assert m, result.stdout
    return m[1]


def result_rows(root, job_id) -> dict[str, dict]:
    rows = read_results(JobPaths(root, job_id).results_dir).to_pylist()
    by_id = {r["id"]: r for r in rows}
    assert len(by_id) == len(rows), "a request has two result rows"
    return by_id


def answers(rows: dict[str, dict]) -> dict[str, tuple]:
    """What must not depend on the input format or path: text, finish reason, token counts."""
    return {i: (r["output"], r["finish_reason"], r["prompt_tokens"], r["output_tokens"]) for i, r in rows.items()}


def check_answers(rows: dict[str, dict], expected_ids):
    """The rows are real answers: one per request, the long one failed, the others generated text."""
    assert set(rows) == set(expected_ids)
    for i, r in rows.items():
        if i in FAILING:
            assert r["finish_reason"] == "error" and r["error"], r
        else:
            assert r["finish_reason"] in ("stop", "length") and r["error"] is None, r
            assert 0 < r["output_tokens"] <= MAX_TOKENS and r["prompt_tokens"] > 0, r
    assert any(rows[i]["output"] for i in rows if i not in FAILING)


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---- a real worker's queue, and the CLI as a process ----------------------------------------

def pipeline_env(data_dir, db_url) -> dict:
    return {**os.environ, "PIPELINE_DATA_DIR": str(data_dir), "PIPELINE_DATABASE_URL": db_url,
            "PIPELINE_BROKER_URL": BROKER_URL, "PIPELINE_QUEUE": QUEUE}


def cli(env, *args, timeout=WAIT_S) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=timeout)


def submit_and_wait(env, src, model_dir) -> str:
    done = cli(env, "submit", src, "--wait", "--model", model_dir, *FAST)
    assert done.returncode == 0, done.stderr
    return check_job_id(done.stdout.strip())


def export_openai(runner, job_id, out, err=None) -> tuple[list[dict], list[dict]]:
    args = ["results", job_id, "--format", "openai", "--output-file", str(out)]
    if err is not None:
        args += ["--error-file", str(err)]
    result = runner.invoke(main, args)
    assert result.exit_code == 0, result.output
    err = err if err is not None else out.with_name(out.stem + ".errors.jsonl")
    return read_jsonl(out), read_jsonl(err)
