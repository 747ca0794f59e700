"""The OpenAI Batch format end to end: batch input files through `pipeline run` and through
`pipeline submit` + a real Celery worker subprocess, `pipeline results --format openai`,
`pipeline status --json`, and bad batch lines rejected before anything is created.

Answers are greedy (temperature 0) on the tiny random Llama, so the same prompts must give
the same text whichever input format or path they came in by.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid

import pytest
from openai.types import Batch, Completion
from openai.types.chat import ChatCompletion

from jobs.ledger import get_job, list_jobs, make_engine, session_factory, upgrade
from jobs.paths import JobPaths, check_job_id, default_database_url
from jobs.results.parquet_files import read_results
from worker_process import BROKER_URL, drop_queue, queued_messages, worker
from cli import main
from cluster import TOO_LONG_FOR_TINY

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
FAST = ["--kv-cache-gib", "0.05", "--device", "cpu"]
QUEUE = f"pipeline-test-openai-{uuid.uuid4().hex[:8]}"  # this module's own queue
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

def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


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

@pytest.fixture(scope="module", autouse=True)
def queue_dropped_at_end():
    yield
    drop_queue(QUEUE)


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


# ---- results --format openai -------------------------------------------------------------------

def export_openai(runner, job_id, out, err=None) -> tuple[list[dict], list[dict]]:
    args = ["results", job_id, "--format", "openai", "--output-file", str(out)]
    if err is not None:
        args += ["--error-file", str(err)]
    result = runner.invoke(main, args)
    assert result.exit_code == 0, result.output
    err = err if err is not None else out.with_name(out.stem + ".errors.jsonl")
    return read_jsonl(out), read_jsonl(err)


def check_output_lines(ok_lines, err_lines, rows, body_type, model_dir):
    # Every custom_id exactly once across the two files; the failing one in the error file.
    custom_ids = [line["custom_id"] for line in ok_lines + err_lines]
    assert sorted(custom_ids) == sorted(rows) and len(set(custom_ids)) == len(custom_ids)
    assert {line["custom_id"] for line in err_lines} == FAILING
    line_ids = [line["id"] for line in ok_lines + err_lines]
    assert len(set(line_ids)) == len(line_ids) and all(i.startswith("batch_req_") for i in line_ids)
    request_ids = set()
    for line in ok_lines:
        row = rows[line["custom_id"]]
        assert line["error"] is None, line
        response = line["response"]
        assert response["status_code"] == 200 and response["request_id"], line
        request_ids.add(response["request_id"])
        body = body_type.model_validate(response["body"])
        (choice,) = body.choices
        text = choice.message.content if body_type is ChatCompletion else choice.text
        assert text == row["output"] and choice.finish_reason == row["finish_reason"]
        assert (body.usage.prompt_tokens, body.usage.completion_tokens, body.usage.total_tokens) == (
            row["prompt_tokens"], row["output_tokens"], row["prompt_tokens"] + row["output_tokens"])
        assert body.model == str(model_dir.resolve())
    assert len(request_ids) == len(ok_lines)
    for line in err_lines:
        row = rows[line["custom_id"]]
        assert line["response"] is None, line
        assert line["error"]["code"] == "request_failed"
        assert line["error"]["message"] == row["error"] and line["error"]["message"]


def test_results_openai_chat(runner, data_root, tmp_path, tiny_model_dir):
    job_id = run_job(runner, chat_batch(tmp_path / "batch.jsonl"), tiny_model_dir)
    rows = result_rows(data_root, job_id)
    ok_lines, err_lines = export_openai(runner, job_id, tmp_path / "out.jsonl", tmp_path / "err.jsonl")
    assert len(ok_lines) == 3 and len(err_lines) == 1
    check_output_lines(ok_lines, err_lines, rows, ChatCompletion, tiny_model_dir)
    for line in ok_lines:
        body = ChatCompletion.model_validate(line["response"]["body"])
        assert body.object == "chat.completion" and body.choices[0].message.role == "assistant"
    # Exporting again gives the same files (ids are stable).
    again = export_openai(runner, job_id, tmp_path / "out2.jsonl", tmp_path / "err2.jsonl")
    assert again == (ok_lines, err_lines)


def test_results_openai_completions(runner, data_root, tmp_path, tiny_model_dir):
    job_id = run_job(runner, completions_batch(tmp_path / "batch.jsonl"), tiny_model_dir)
    rows = result_rows(data_root, job_id)
    # Without --error-file the errors go next to the output file, as OUTPUT.errors.jsonl.
    ok_lines, err_lines = export_openai(runner, job_id, tmp_path / "out.jsonl")
    assert len(ok_lines) == 2 and len(err_lines) == 1
    check_output_lines(ok_lines, err_lines, rows, Completion, tiny_model_dir)
    assert all(Completion.model_validate(line["response"]["body"]).object == "text_completion" for line in ok_lines)


def test_results_openai_needs_an_output_file(runner, data_root, tmp_path, tiny_model_dir):
    job_id = run_job(runner, completions_batch(tmp_path / "batch.jsonl"), tiny_model_dir)
    result = runner.invoke(main, ["results", job_id, "--format", "openai"])
    assert result.exit_code == 2 and "--output-file" in result.output, result.output


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


# ---- bad batch lines -----------------------------------------------------------------------------

GOOD = openai_line("a", CHAT, {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})


def bad(custom_id, **changes):
    line = {**GOOD, "custom_id": custom_id, **changes}
    return {k: v for k, v in line.items() if v is not ...}


def bad_body(custom_id, **changes):
    return bad(custom_id, body={**GOOD["body"], **changes})


# (line, what the message must say) after GOOD on line 1
BAD_LINES = {
    "wrong method": (bad("m", method="GET"), "method must be \"POST\""),
    "unknown url": (bad("u", url="/v1/moderations"), "unknown url"),
    "missing body": (bad("b", body=...), "missing body"),
    "duplicate custom_id": (bad("a"), "duplicate id 'a' (first on line 1)"),
    "logprobs": (bad_body("l", logprobs=True, top_logprobs=21), "top_logprobs must be between 0 and 20"),
    "n=0": (bad_body("n", n=0), "n must be between 1 and 128, got 0"),
    "other url": (bad("o", url=COMPLETIONS, body={"prompt": "Hi"}), "every line of a batch must use the same url"),
    "other model": (bad_body("g", model="gpt-4o"), "model 'gpt-4o' is not the job's model"),
}


def assert_nothing_created(runner, data_root, db_url):
    assert not (data_root / "jobs").exists() or not any((data_root / "jobs").iterdir())
    engine = make_engine(db_url)
    try:
        with session_factory(engine)() as s:
            assert list_jobs(s) == []
    finally:
        engine.dispose()
    listing = runner.invoke(main, ["list"], env={"PIPELINE_DATABASE_URL": db_url})
    assert listing.exit_code == 0 and "no jobs yet" in listing.stdout, listing.output


@pytest.mark.parametrize("case", list(BAD_LINES))
@pytest.mark.parametrize("command", ["run", "submit"])
def test_each_bad_batch_line_exits_2_and_creates_nothing(runner, data_root, tmp_path, command, case):
    line, message = BAD_LINES[case]
    src = write_jsonl(tmp_path / "bad.jsonl", [GOOD, line, {**GOOD, "custom_id": "z"}])
    db_url = default_database_url(data_root)
    result = runner.invoke(main, [command, str(src), *FAST],
                           env={"PIPELINE_BROKER_URL": BROKER_URL, "PIPELINE_QUEUE": QUEUE})
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.stderr.splitlines() if re.match(r"\s*line \d+:", ln)]
    assert len(errors) == 1 and errors[0].strip().startswith("line 2:") and message in errors[0], result.stderr
    assert "1 error(s)" in result.stderr and "nothing was submitted" in result.stderr
    assert result.stdout == ""  # submit prints a job id on stdout only when it made one
    assert_nothing_created(runner, data_root, db_url)


@pytest.mark.parametrize("command", ["run", "submit"])
def test_a_file_of_bad_batch_lines_reports_every_line(data_root, db_url, tmp_path, command, runner):
    """A real `pipeline` process on each ledger backend: every bad line by number, exit 2,
    no job row, no job directory, nothing on this module's queue."""
    rows = [GOOD] + [line for line, _ in BAD_LINES.values()] + [{**GOOD, "custom_id": "z"}]
    src = write_jsonl(tmp_path / "bad.jsonl", rows)
    env = pipeline_env(data_root, db_url)
    done = cli(env, command, src, *FAST, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    reported = {int(m[1]): m[2] for m in re.finditer(r"^\s*line (\d+): (.*)$", done.stderr, re.M)}
    assert sorted(reported) == list(range(2, 2 + len(BAD_LINES))), done.stderr
    for number, (_, message) in enumerate(BAD_LINES.values(), start=2):
        assert message in reported[number], (number, reported[number])
    assert f"{len(BAD_LINES)} error(s)" in done.stderr
    assert_nothing_created(runner, data_root, db_url)
    assert queued_messages(QUEUE) == 0


def test_an_unchanged_openai_file_runs_under_its_served_model_names(runner, data_root, tmp_path, tiny_model_dir):
    """Every line names "gpt-4o-mini" (or an alias): with --served-model-name they run, and
    each output line reports the name its line used; the fields a batch cannot act on but
    need not refuse (user, metadata, store, service_tier, stream false, any field as null) are
    taken, and content given as text parts is the same prompt as that text."""
    ignored = {"user": "nightly", "metadata": {"team": "a"}, "store": False, "service_tier": "auto", "stream": False,
               "audio": None}
    as_parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in CHATS["greet"]]
    rows = [openai_line(f"c{i}", CHAT, {"model": name, "messages": messages, "temperature": 0,
                                        "max_tokens": MAX_TOKENS, **ignored})
            for i, (name, messages) in enumerate([("gpt-4o-mini", CHATS["greet"]), ("gpt-4o-mini", as_parts),
                                                  ("our-alias", CHATS["greet"])])]
    src = write_jsonl(tmp_path / "batch.jsonl", rows)
    done = runner.invoke(main, ["run", str(src), "--model", str(tiny_model_dir), *FAST])
    assert done.exit_code == 2 and "model 'gpt-4o-mini' is not the job's model" in done.stderr, done.output
    done = runner.invoke(main, ["run", str(src), "--model", str(tiny_model_dir), *FAST,
                                "--served-model-name", "gpt-4o-mini", "--served-model-name", "our-alias"])
    assert done.exit_code == 0, done.output
    job_id = re.search(r"job (job_[0-9a-f]{16})", done.stderr)[1]
    out = tmp_path / "out.jsonl"
    assert runner.invoke(main, ["results", job_id, "--export", str(out), "--format", "openai"]).exit_code == 0
    lines = {line["custom_id"]: line for line in map(json.loads, out.read_text().splitlines())}
    bodies = {cid: ChatCompletion.model_validate(line["response"]["body"]) for cid, line in lines.items()}
    assert {cid: body.model for cid, body in bodies.items()} == {"c0": "gpt-4o-mini", "c1": "gpt-4o-mini",
                                                                 "c2": "our-alias"}
    assert bodies["c1"].choices[0].message.content == bodies["c0"].choices[0].message.content
    assert bodies["c1"].usage.prompt_tokens == bodies["c0"].usage.prompt_tokens
    assert read_results(JobPaths(data_root, job_id).results_dir)["model"].to_pylist() == [
        "gpt-4o-mini", "gpt-4o-mini", "our-alias"]


def test_n_choices_run_as_one_output_line_each_and_one_result_row_per_choice(runner, data_root, tmp_path,
                                                                             bundled_model_dir):
    """On the bundled model: n=4 greedy answers "Paris" four times, n=3 seeded sampling gives
    three answers; one OpenAI line per request holding its n choices (the prompt counted once),
    one result row per (id, choice), the prompt computed once (the other choices' cached_tokens)."""
    capital = {"model": "SmolLM2-135M-Instruct", "messages": CHATS["capital"], "max_tokens": 8, "temperature": 0}
    rows = [openai_line("greedy", CHAT, {**capital, "n": 4}),
            openai_line("sampled", CHAT, {**capital, "n": 3, "temperature": 0.9, "seed": 5, "max_tokens": 12}),
            openai_line("single", CHAT, capital)]
    job_id = run_job(runner, write_jsonl(tmp_path / "batch.jsonl", rows), bundled_model_dir)
    table = read_results(JobPaths(data_root, job_id).results_dir).to_pylist()
    assert [(r["id"], r["choice"]) for r in table] == [
        ("greedy", 0), ("greedy", 1), ("greedy", 2), ("greedy", 3), ("sampled", 0), ("sampled", 1), ("sampled", 2),
        ("single", 0)]
    by_key = {(r["id"], r["choice"]): r for r in table}
    single = by_key["single", 0]
    assert "Paris" in single["output"]
    assert all(by_key["greedy", c]["output"] == single["output"] for c in range(4))
    prompt_tokens = single["prompt_tokens"]
    assert all(by_key["greedy", c]["cached_tokens"] == prompt_tokens for c in (1, 2, 3))
    assert all(by_key["sampled", c]["cached_tokens"] == prompt_tokens for c in (1, 2))
    with session_factory(make_engine(default_database_url(data_root)))() as s:
        job = get_job(s, job_id)
        assert (job.total_requests, job.completed_requests, job.failed_requests) == (3, 3, 0)
        assert job.output_tokens == sum(r["output_tokens"] for r in table)
    ok_lines, err_lines = export_openai(runner, job_id, tmp_path / "out.jsonl")
    assert err_lines == [] and [line["custom_id"] for line in ok_lines] == ["greedy", "sampled", "single"]
    bodies = {line["custom_id"]: ChatCompletion.model_validate(line["response"]["body"]) for line in ok_lines}
    greedy = bodies["greedy"]
    assert [c.index for c in greedy.choices] == [0, 1, 2, 3]
    assert {c.message.content for c in greedy.choices} == {single["output"]}
    sampled = bodies["sampled"]
    assert [c.message.content for c in sampled.choices] == [by_key["sampled", c]["output"] for c in range(3)]
    assert sampled.usage.prompt_tokens == prompt_tokens   # once, not once per choice
    assert sampled.usage.completion_tokens == sum(by_key["sampled", c]["output_tokens"] for c in range(3))


def test_echo_puts_the_prompt_and_its_logprobs_before_the_answers(runner, data_root, tmp_path, tiny_model_dir):
    body = {"model": "m", "prompt": PROMPTS["story"], "max_tokens": 4, "temperature": 0}
    rows = [openai_line("plain", COMPLETIONS, body), openai_line("echoed", COMPLETIONS, {**body, "echo": True}),
            openai_line("scored", COMPLETIONS, {**body, "echo": True, "logprobs": 2}),
            openai_line("answer_only", COMPLETIONS, {**body, "logprobs": 2})]
    done = runner.invoke(main, ["run", str(write_jsonl(tmp_path / "echo.jsonl", rows)), "--model",
                                str(tiny_model_dir), "--served-model-name", "m", *FAST])
    assert done.exit_code == 0, done.output
    job_id = re.search(r"job (job_[0-9a-f]{16})", done.stderr)[1]
    by_id = result_rows(data_root, job_id)
    assert by_id["echoed"]["output"] == by_id["scored"]["output"] == PROMPTS["story"] + by_id["plain"]["output"]
    ok_lines, _ = export_openai(runner, job_id, tmp_path / "out.jsonl")
    bodies = {line["custom_id"]: line["response"]["body"] for line in ok_lines}
    texts = {cid: Completion.model_validate(b).choices[0].text for cid, b in bodies.items() if cid != "scored"}
    assert texts["echoed"] == PROMPTS["story"] + texts["plain"]
    # OpenAI's echo: one entry per prompt token, then the answer's; the first prompt token's are
    # null, which the openai types do not allow: validated with that entry left out.
    scored = bodies["scored"]["choices"][0]
    logprobs = scored["logprobs"]
    prompt_tokens = by_id["scored"]["prompt_tokens"]
    assert len(logprobs["tokens"]) == prompt_tokens + by_id["scored"]["output_tokens"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(isinstance(lp, float) and lp <= 0 for lp in logprobs["token_logprobs"][1:])
    assert "".join(logprobs["tokens"]) == scored["text"]
    assert logprobs["tokens"][prompt_tokens:] == bodies["answer_only"]["choices"][0]["logprobs"]["tokens"]
    assert logprobs["token_logprobs"][prompt_tokens:] == bodies["answer_only"]["choices"][0]["logprobs"]["token_logprobs"]
    trimmed = {**scored, "logprobs": {key: values[1:] for key, values in logprobs.items()}}
    Completion.model_validate({**bodies["scored"], "choices": [trimmed]})


def test_a_responses_file_answers_as_its_chat_file_does_in_response_objects(runner, data_root, tmp_path,
                                                                              bundled_model_dir):
    """/v1/responses lines on the bundled model, greedy: instructions and input, a JSON schema
    (text.format), a forced function call and logprobs. Each answers exactly as its
    /v1/chat/completions twin does; the output lines are the openai package's Response."""
    import jsonschema
    from openai.types.responses import Response

    person = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    weather = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
               "additionalProperties": False}
    base = {"model": "SmolLM2-135M-Instruct", "temperature": 0}
    twins = {
        "capital": ({"instructions": "You answer in one word.", "input": "What is the capital of France?",
                     "max_output_tokens": 8},
                    {"messages": CHATS["capital"], "max_tokens": 8}),
        "person": ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "Extract: Alice is 30."}]}],
                    "text": {"format": {"type": "json_schema", "name": "person", "schema": person, "strict": True}},
                    "max_output_tokens": 40},
                   {"messages": [{"role": "user", "content": "Extract: Alice is 30."}], "max_tokens": 40,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": person}}}),
        "call": ({"input": "What is the weather in Paris?", "max_output_tokens": 40,
                  "tools": [{"type": "function", "name": "get_weather", "parameters": weather}],
                  "tool_choice": {"type": "function", "name": "get_weather"}},
                 {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "max_tokens": 40,
                  "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": weather}}],
                  "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
        "scored": ({"input": "Is 'I love it' positive? Answer yes or no.", "max_output_tokens": 2,
                    "top_logprobs": 2, "include": ["message.output_text.logprobs"]},
                   {"messages": [{"role": "user", "content": "Is 'I love it' positive? Answer yes or no."}],
                    "max_tokens": 2, "logprobs": True, "top_logprobs": 2}),
    }
    jobs = {}
    for url, which in (("/v1/responses", 0), (CHAT, 1)):
        src = write_jsonl(tmp_path / f"{which}.jsonl", [openai_line(cid, url, {**base, **pair[which]})
                                                        for cid, pair in twins.items()])
        done = runner.invoke(main, ["run", str(src), "--model", str(bundled_model_dir), "--no-reuse", *FAST])
        assert done.exit_code == 0, done.output
        jobs[url] = re.search(r"job (job_[0-9a-f]{16}): completed", done.stdout)[1]
    ours, theirs = (result_rows(data_root, jobs[url]) for url in ("/v1/responses", CHAT))
    assert {r["reused_from"] for r in theirs.values()} == {None}   # both computed, neither reused
    assert {i: r["request_key"] for i, r in ours.items()} == {i: r["request_key"] for i, r in theirs.items()}
    assert answers(ours) == answers(theirs)
    assert {i: (r["tool_call"], r["logprobs"]) for i, r in ours.items()} == {
        i: (r["tool_call"], r["logprobs"]) for i, r in theirs.items()}
    ok_lines, err_lines = export_openai(runner, jobs["/v1/responses"], tmp_path / "out.jsonl")
    assert err_lines == [] and [line["custom_id"] for line in ok_lines] == list(twins)
    bodies = {line["custom_id"]: Response.model_validate(line["response"]["body"]) for line in ok_lines}
    assert "Paris" in bodies["capital"].output_text and bodies["capital"].status == "completed"
    jsonschema.validate(json.loads(bodies["person"].output_text), person)
    (call,) = bodies["call"].output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), weather)
    (message,) = bodies["scored"].output
    assert bodies["scored"].status == "incomplete" and bodies["scored"].incomplete_details.reason == "max_output_tokens"
    logprobs = message.content[0].logprobs
    assert len(logprobs) == ours["scored"]["output_tokens"] == 2
    assert all(len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.logprob for entry in logprobs)
    for cid, body in bodies.items():
        row = ours[cid]
        assert (body.usage.input_tokens, body.usage.output_tokens) == (row["prompt_tokens"], row["output_tokens"])
