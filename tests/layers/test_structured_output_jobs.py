"""Structured outputs through a whole job on the bundled model: OpenAI batch lines with JSON
schemas, JSON mode and a forced tool call come back in OpenAI's shapes and validate; bad
schemas, regexes and tool choices are refused with their line numbers; and lines sharing one
schema compile it once."""
from __future__ import annotations

import json

import jsonschema
import pytest

from structured_output_helpers import SCHEMA

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # see conftest: small matmuls on a shared 2-core box

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


def chat_line(custom_id: str, content: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": content}],
                     "temperature": 0, "max_tokens": 120, **body}}


def test_a_batch_with_schemas_and_a_forced_tool_call_comes_back_in_openai_shapes(runner, data_root, tmp_path,
                                                                                 Session):
    from openai.types.chat import ChatCompletion

    from jobs.ledger import list_jobs
    from cli import main

    lines = [
        chat_line("movie", "Describe the movie Jaws as JSON.", response_format={
            "type": "json_schema", "json_schema": {"name": "movie", "schema": SCHEMA, "strict": True}}),
        chat_line("mode", "Reply with a JSON object with the keys city and country, for Paris.",
                  response_format={"type": "json_object"}),
        chat_line("tool", "What is the weather in Paris?", tools=[WEATHER],
                  tool_choice={"type": "function", "function": {"name": "get_weather"}}),
        chat_line("plain", "What is the capital of France?", response_format={"type": "text"}),
    ]
    src = tmp_path / "batch.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = runner.invoke(main, ["run", str(src), "--device", "cpu", "--dtype", "float32", "--kv-cache-gib", "0.2"])
    assert done.exit_code == 0, done.output
    with Session() as s:
        (job,) = list_jobs(s)
    assert (job.constrained_requests, job.constrained_valid) == (3, 3)
    out = tmp_path / "out.jsonl"
    assert runner.invoke(main, ["results", job.id, "--export", str(out), "--format", "openai"]).exit_code == 0
    bodies = {line["custom_id"]: ChatCompletion.model_validate(line["response"]["body"])
              for line in map(json.loads, out.read_text().splitlines())}
    jsonschema.validate(json.loads(bodies["movie"].choices[0].message.content), SCHEMA)
    assert isinstance(json.loads(bodies["mode"].choices[0].message.content), dict)
    tool = bodies["tool"].choices[0]
    assert tool.finish_reason == "tool_calls" and tool.message.content is None
    (call,) = tool.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert "Paris" in bodies["plain"].choices[0].message.content


def test_bad_schemas_regexes_and_tool_choices_are_refused_with_their_line_numbers(runner, data_root, tmp_path):
    from cli import main

    lines = [
        chat_line("ok", "Hi", response_format={"type": "json_object"}),
        chat_line("schema", "Hi", response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strung"}}}}}),
        chat_line("regex", "Hi", structured_outputs={"regex": "[0-9"}),
        chat_line("auto", "Hi", tools=[WEATHER]),
        chat_line("both", "Hi", tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
        chat_line("kind", "Hi", response_format={"type": "yaml"}),
    ]
    src = tmp_path / "bad.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = runner.invoke(main, ["submit", str(src)])
    assert done.exit_code == 2, done.output
    for number, says in ((2, "strung"), (3, "unclosed character class"), (4, "auto (the default with tools)"),
                         (5, "not both"), (6, "response_format must be an object with type")):
        assert any(line.startswith(f"line {number}:") and says in line for line in done.stderr.splitlines()), \
            (number, done.stderr)
    assert "line 1:" not in done.stderr and not (data_root / "jobs").exists()


def test_validating_many_lines_that_share_one_schema_compiles_it_once(tmp_path):
    from jobs.input.line_checks import validate
    from pipeline import structured_output

    line = json.dumps(chat_line("x", "Hi", response_format={
        "type": "json_schema", "json_schema": {"name": "movie", "schema": SCHEMA}}))
    src = tmp_path / "many.jsonl"
    src.write_text("".join(line.replace('"x"', f'"x{i}"', 1) + "\n" for i in range(2000)))
    structured_output._check.cache_clear()
    assert validate(src).ok
    assert (structured_output._check.misses, structured_output._check.hits) == (1, 1999)
