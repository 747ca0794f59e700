"""The OpenAI Batch format end to end: batch input files through `pipeline run` and through
`pipeline submit` + a real Celery worker subprocess, and `pipeline status --json`.

Answers are greedy (temperature 0) on the tiny random Llama, so the same prompts must give
the same text whichever input format or path they came in by. The output files
(`pipeline results --format openai`) and the other endpoints' shapes: test_openai_results.py;
bad batch lines: test_openai_bad_lines.py.
"""
from __future__ import annotations

import json

import pytest
from openai.types import Batch, Completion

from jobs.ledger import get_job, upgrade
from jobs.paths import JobPaths
from jobs.results.parquet_files import read_results
from worker_process import drop_queue, worker
from cli import main
from openai_batch_helpers import (
    CHAT, CHATS, COMPLETIONS, FAST, MAX_TOKENS, PROMPTS, QUEUE, answers, chat_batch, chat_pipeline, check_answers,
    cli, completions_batch, completions_pipeline, export_openai, openai_line, pipeline_env, result_rows, run_job,
    submit_and_wait, write_jsonl,
)


@pytest.fixture(scope="module", autouse=True)
def queue_dropped_at_end():
    yield
    drop_queue(QUEUE)


# ---- same answers in both formats ------------------------------------------------------------

def test_chat_batch_gives_the_same_answers_as_the_pipeline_format(runner, data_root, tmp_path, tiny_model_dir):
    openai_job = run_job(runner, chat_batch(tmp_path / "batch.jsonl"), tiny_model_dir)
    ours_job = run_job(runner, chat_pipeline(tmp_path / "ours.jsonl"), tiny_model_dir)
    assert openai_job != ours_job
    openai_rows, ours_rows = result_rows(data_root, openai_job), result_rows(data_root, ours_job)
    check_answers(openai_rows, CHATS)
    assert answers(openai_rows) == answers(ours_rows)
    # max_completion_tokens is honoured like max_tokens (the random model runs to the limit).
    assert openai_rows["mct"]["output_tokens"] == ours_rows["mct"]["output_tokens"]


def test_completions_batch_gives_the_same_answers_as_the_pipeline_format(runner, data_root, tmp_path,
                                                                         tiny_model_dir):
    openai_job = run_job(runner, completions_batch(tmp_path / "batch.jsonl"), tiny_model_dir)
    ours_job = run_job(runner, completions_pipeline(tmp_path / "ours.jsonl"), tiny_model_dir)
    openai_rows = result_rows(data_root, openai_job)
    check_answers(openai_rows, PROMPTS)
    assert answers(openai_rows) == answers(result_rows(data_root, ours_job))


def test_a_list_of_prompts_answers_each_as_its_own_line_would(runner, data_root, tmp_path, tiny_model_dir):
    """OpenAI completions' list `prompt` (texts, or token ids): each prompt's n answers are
    the ones that prompt gets alone, numbered i * n + j as OpenAI numbers them, in one output
    line whose usage counts every prompt once; echo puts each choice's own prompt first."""
    texts = list(PROMPTS.values())[:2]
    greedy = {"max_tokens": MAX_TOKENS, "temperature": 0}
    alone = run_job(runner, write_jsonl(tmp_path / "alone.jsonl", [
        openai_line(f"alone{i}", COMPLETIONS, {"prompt": text, **greedy}) for i, text in enumerate(texts)]),
        tiny_model_dir)
    alone_rows = result_rows(data_root, alone)
    ids = [101, 102, 103, 104]
    job = run_job(runner, write_jsonl(tmp_path / "lists.jsonl", [
        openai_line("texts", COMPLETIONS, {"prompt": texts, "n": 2, **greedy}),
        openai_line("echo", COMPLETIONS, {"prompt": texts, "echo": True, **greedy}),
        openai_line("ids", COMPLETIONS, {"prompt": ids, **greedy}),
        openai_line("id-lists", COMPLETIONS, {"prompt": [ids, ids[:2]], **greedy})]), tiny_model_dir)
    rows = read_results(JobPaths(data_root, job).results_dir).to_pylist()
    by_key = {(r["id"], r["choice"]): r for r in rows}
    assert sorted(by_key) == sorted([("texts", c) for c in range(4)] + [("echo", 0), ("echo", 1), ("ids", 0),
                                                                        ("id-lists", 0), ("id-lists", 1)])
    for choice in range(4):   # prompt i's answers are choices 2i and 2i + 1
        row, expected = by_key["texts", choice], alone_rows[f"alone{choice // 2}"]
        assert (row["output"], row["prompt_tokens"], row["prompt_index"]) == (
            expected["output"], expected["prompt_tokens"], choice // 2)
    assert [by_key["echo", i]["output"] for i in range(2)] == [texts[i] + alone_rows[f"alone{i}"]["output"]
                                                                for i in range(2)]
    assert (by_key["ids", 0]["prompt_tokens"], by_key["ids", 0]["prompt_index"]) == (4, 0)   # prompts: [ids]
    assert [by_key["id-lists", i]["prompt_tokens"] for i in range(2)] == [4, 2]
    assert by_key["id-lists", 0]["output"] == by_key["ids", 0]["output"]   # the same token ids, the same answer
    ok_lines, err_lines = export_openai(runner, job, tmp_path / "out.jsonl")
    assert err_lines == []
    bodies = {line["custom_id"]: Completion.model_validate(line["response"]["body"]) for line in ok_lines}
    listed = bodies["texts"]
    assert [c.index for c in listed.choices] == [0, 1, 2, 3]
    assert [c.text for c in listed.choices] == [by_key["texts", c]["output"] for c in range(4)]
    assert listed.usage.prompt_tokens == sum(alone_rows[f"alone{i}"]["prompt_tokens"] for i in range(2))
    assert listed.usage.completion_tokens == sum(by_key["texts", c]["output_tokens"] for c in range(4))
    assert bodies["id-lists"].usage.prompt_tokens == 6 and bodies["ids"].usage.prompt_tokens == 4
    # The dry run counts every prompt's rows and tokens; a rerun takes every answer back whole.
    dry = runner.invoke(main, ["run", str(tmp_path / "lists.jsonl"), "--model", str(tiny_model_dir), *FAST,
                               "--dry-run", "--json"])
    assert dry.exit_code == 0, dry.output
    figures = json.loads(dry.stdout)
    assert (figures["lines"], figures["rows"], figures["reused"]) == (4, 9, 4)
    assert figures["prompt_tokens"] == 2 * listed.usage.prompt_tokens + 4 + 6   # texts, echo, ids, id-lists
    rerun = run_job(runner, tmp_path / "lists.jsonl", tiny_model_dir)
    again = read_results(JobPaths(data_root, rerun).results_dir).to_pylist()
    assert {(r["id"], r["choice"]): (r["output"], r["prompt_index"]) for r in again} == {
        key: (r["output"], r["prompt_index"]) for key, r in by_key.items()}
    assert {r["reused_from"] for r in again} == {job}

# ---- through a real worker ---------------------------------------------------------------------

def test_chat_batch_through_a_worker_matches_run_and_the_pipeline_format(runner, data_root, pg_url, tmp_path,
                                                                         tiny_model_dir):
    """On PostgreSQL: `submit` of the batch file and of our own format to a worker subprocess,
    compared with each other and with `pipeline run` of the batch file (SQLite, in process)."""
    upgrade(pg_url)
    worker_dir = tmp_path / "worker-data"
    worker_dir.mkdir()
    env = pipeline_env(worker_dir, pg_url)
    batch_src, ours_src = chat_batch(tmp_path / "batch.jsonl"), chat_pipeline(tmp_path / "ours.jsonl")
    with worker(env, tmp_path / "worker.log", "--model", tiny_model_dir, *FAST):
        openai_job = submit_and_wait(env, batch_src, tiny_model_dir)
        ours_job = submit_and_wait(env, ours_src, tiny_model_dir)
    worker_rows = result_rows(worker_dir, openai_job)
    check_answers(worker_rows, CHATS)
    assert answers(worker_rows) == answers(result_rows(worker_dir, ours_job))
    run_rows = result_rows(data_root, run_job(runner, batch_src, tiny_model_dir))
    assert answers(worker_rows) == answers(run_rows)

    # The worker's job, as the worker's ledger reports it, is a completed chat batch.
    done = cli(env, "status", openai_job, "--json", timeout=60)
    assert done.returncode == 0, done.stderr
    batch = Batch.model_validate(json.loads(done.stdout))
    assert (batch.id, batch.object, batch.status, batch.endpoint) == (openai_job, "batch", "completed", CHAT)
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (4, 3, 1)
    assert batch.usage.output_tokens == sum(r["output_tokens"] for r in worker_rows.values())

# ---- status --json ------------------------------------------------------------------------------

@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
def test_status_json_is_the_batch_of_the_job(runner, data_root, tmp_path, tiny_model_dir, Session, endpoint):
    make = chat_batch if endpoint == CHAT else completions_batch
    job_id = run_job(runner, make(tmp_path / "batch.jsonl"), tiny_model_dir)
    rows = result_rows(data_root, job_id)
    result = runner.invoke(main, ["status", job_id, "--json"])
    assert result.exit_code == 0, result.output
    raw = json.loads(result.stdout)
    batch = Batch.model_validate(raw)
    with Session() as s:
        job = get_job(s, job_id)
    assert (batch.id, batch.object, batch.status, batch.endpoint) == (job_id, "batch", "completed", endpoint)
    counts = (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed)
    assert counts == (job.total_requests, job.completed_requests, job.failed_requests) == (len(rows), len(rows) - 1, 1)
    prompt_tokens = sum(r["prompt_tokens"] for r in rows.values())
    output_tokens = sum(r["output_tokens"] for r in rows.values())
    assert output_tokens > 0
    assert (batch.usage.input_tokens, batch.usage.output_tokens) == (job.prompt_tokens, job.output_tokens)
    assert (batch.usage.input_tokens, batch.usage.output_tokens) == (prompt_tokens, output_tokens)
    assert batch.usage.total_tokens == prompt_tokens + output_tokens
    assert batch.created_at and batch.in_progress_at and batch.completed_at
    assert batch.created_at <= batch.in_progress_at <= batch.completed_at
    assert batch.failed_at is None and batch.cancelled_at is None and batch.expired_at is None
    assert batch.model == str(tiny_model_dir.resolve())
    # The ledger's own word on the job is under "pipeline"; its status is the same.
    assert raw["pipeline"]["status"] == "completed" and raw["pipeline"]["input_format"] == "openai"
