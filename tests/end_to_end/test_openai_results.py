"""`pipeline results --format openai`: every custom_id once across the output and error files,
each body the openai package's type, for chat, completions (echo and logprobs), n choices
and /v1/responses; and an unchanged hosted file running under its served model names."""
from __future__ import annotations

import json
import re

from openai.types import Completion
from openai.types.chat import ChatCompletion

from jobs.ledger import get_job, make_engine, session_factory
from jobs.paths import JobPaths, default_database_url
from jobs.results.parquet_files import read_results
from cli import main
from openai_batch_helpers import (
    CHAT, CHATS, COMPLETIONS, FAILING, FAST, MAX_TOKENS, PROMPTS, answers, chat_batch, completions_batch,
    export_openai, openai_line, result_rows, run_job, write_jsonl,
)


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
