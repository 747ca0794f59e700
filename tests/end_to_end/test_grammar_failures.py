"""Grammars that fail, through the real CLI on the tiny model: a spec llguidance fails on from
its start (a limit of its lexer or parser, or no answer at all) is a line error at submit,
with its line number; one that fails only on the branch a model takes is that request's own
error row, which `pipeline retry --only-failed` runs again and which is never stored for reuse.
"""
from __future__ import annotations

import json
import re

from sqlalchemy import select
from transformers import AutoTokenizer

from jobs.ledger import Answer, get_job
from jobs.paths import JobPaths
from jobs.results.parquet_files import read_results
from cli import main

FAST = ["--kv-cache-gib", "0.05", "--device", "cpu"]
CYCLE = {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}
REQUIRED_CYCLE = {"$defs": CYCLE, "type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]}


def write(tmp_path, lines) -> str:
    src = tmp_path / f"in-{len(list(tmp_path.glob('in-*.jsonl')))}.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(src)


def line_errors(stderr: str) -> dict[int, str]:
    return {int(m[1]): m[2] for m in re.finditer(r"^line (\d+): (.*)$", stderr, re.M)}


def test_grammars_that_fail_from_their_start_are_refused_at_submit_with_their_line_numbers(runner, data_root,
                                                                                           tmp_path):
    specs = [   # line 1 is a good one
        ({"regex": "a{1000000}"}, "llguidance cannot follow the grammar: lexer error: too many expressions constructed"),
        ({"regex": "(a{1000}){1000}"}, "llguidance cannot follow the grammar: lexer error: too many expressions"),
        ({"grammar": 'start: "a"~1000000'}, "llguidance cannot follow the grammar: parser error: Too many items"),
        ({"json": {"$defs": CYCLE, "$ref": "#/$defs/a"}}, "the grammar admits no answer (llguidance: NoExtension"),
        ({"json": REQUIRED_CYCLE}, """the grammar admits no answer that starts with '{"x":'"""),
        ({"grammar": "start: a\na: b\nb: a"}, "the grammar admits no answer (llguidance: NoExtension"),
    ]
    lines = [{"id": "ok", "prompt": "Hi", "structured_outputs": {"regex": "b|a{1000000}"}}]
    lines += [{"id": f"bad{i}", "prompt": "Hi", "structured_outputs": spec} for i, (spec, _) in enumerate(specs)]
    done = runner.invoke(main, ["submit", write(tmp_path, lines)])
    assert done.exit_code == 2, done.output
    errors = line_errors(done.stderr)
    assert set(errors) == set(range(2, 2 + len(specs))), done.stderr
    for number, (_, says) in enumerate(specs, start=2):
        assert errors[number].startswith(f"structured_outputs: {says}"), (number, errors[number])

    # OpenAI lines: a schema in response_format, and a forced tool's parameters.
    def chat(custom_id, **body):
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}], **body}}
    tool = {"type": "function", "function": {"name": "f", "parameters": REQUIRED_CYCLE}}
    lines = [chat("ok", response_format={"type": "json_object"}),
             chat("schema", response_format={"type": "json_schema", "json_schema": {
                 "name": "x", "schema": {"$defs": CYCLE, "$ref": "#/$defs/b"}}}),
             chat("tool", tools=[tool], tool_choice={"type": "function", "function": {"name": "f"}})]
    done = runner.invoke(main, ["submit", write(tmp_path, lines)])
    assert done.exit_code == 2, done.output
    assert line_errors(done.stderr) == {
        2: "response_format: the grammar admits no answer (llguidance: NoExtensionBias)",
        3: """tools: the parameters of 'f': the grammar admits no answer that starts with '{"x":' """
           "(llguidance: NoExtensionBias)"}, done.stderr
    assert not (data_root / "jobs").exists()


def rows_of(root, job_id) -> dict[str, dict]:
    return {r["id"]: r for r in read_results(JobPaths(root, job_id).results_dir).to_pylist()}


def test_a_grammar_that_fails_while_decoding_is_a_failed_row_retried_and_never_reused(runner, data_root, tmp_path,
                                                                                     tiny_model_dir, Session):
    """logit_bias steers two requests onto the branch of their grammar that llguidance fails
    on (decided only by the model's choice, so submit accepts them); two good requests share
    their shard."""
    a, y = AutoTokenizer.from_pretrained(tiny_model_dir).convert_tokens_to_ids(["a", "y"])
    lines = [
        {"id": "good", "prompt": "Say hi", "max_tokens": 4, "temperature": 0},
        {"id": "good-json", "prompt": "JSON:", "max_tokens": 8, "temperature": 0,
         "structured_outputs": {"choice": ["yes", "no"]}},
        {"id": "limit", "prompt": "Say a", "max_tokens": 8, "temperature": 0, "logit_bias": {str(a): 100},
         "structured_outputs": {"regex": "b|a{1000000}"}},
        {"id": "dead-end", "prompt": "Say y", "max_tokens": 8, "temperature": 0, "logit_bias": {str(y): 100},
         "structured_outputs": {"grammar": 'start: "x" | "y" a\na: b\nb: a'}},
    ]
    src = write(tmp_path, lines)

    def run(*args) -> str:
        done = runner.invoke(main, [*args, "--model", str(tiny_model_dir), *FAST] if args[0] == "run" else args)
        assert done.exit_code == 0, done.output
        return re.search(r"(job_[0-9a-f]{16})", done.stdout)[1]

    first = run("run", src)
    rows = rows_of(data_root, first)
    assert {rid: row["finish_reason"] for rid, row in rows.items()} == {
        "good": "length", "good-json": "stop", "limit": "error", "dead-end": "error"}
    assert rows["limit"]["error"] == ("structured output: llguidance cannot follow the grammar after 'a': "
                                      "lexer error: too many expressions constructed")
    assert rows["dead-end"]["error"].startswith(
        "structured output: the grammar admits no answer that starts with 'y' (llguidance: NoExtension")
    assert (rows["limit"]["valid"], rows["dead-end"]["valid"], rows["good-json"]["valid"]) == (False, False, True)
    assert rows["limit"]["output"] == "a" and rows["dead-end"]["output"] == "y"
    with Session() as s:
        job = get_job(s, first)
        assert (job.completed_requests, job.failed_requests) == (2, 2)
        assert set(s.scalars(select(Answer.request_id).where(Answer.job_id == first))) == {"good", "good-json"}

    # retry --only-failed runs exactly the two again (they fail again: the grammar is the same).
    retried = run("retry", first, "--only-failed", "--local")
    again = rows_of(data_root, retried)
    assert set(again) == {"limit", "dead-end"}
    assert all(r["finish_reason"] == "error" and r["reused_from"] is None for r in again.values())

    # A rerun of the file reuses the good answers and computes the failed ones again.
    rerun = rows_of(data_root, run("run", src))
    assert {rid: row["reused_from"] for rid, row in rerun.items()} == {
        "good": first, "good-json": first, "limit": None, "dead-end": None}
    assert rerun["limit"]["error"] == rows["limit"]["error"] and rerun["dead-end"]["finish_reason"] == "error"
    with Session() as s:
        assert not set(s.scalars(select(Answer.request_id).where(Answer.request_id.in_(["limit", "dead-end"]))))
