"""Reasoning models end to end: `pipeline run` on a tiny random Qwen3 whose chat template is
Qwen3's, `reasoning_effort` given to the template, the think block split into the
`reasoning` column, and `pipeline results --format openai` carrying it as vLLM does
(`message.reasoning_content`, `usage.completion_tokens_details.reasoning_tokens`), checked
with the `openai` package's own types. A random model never closes a think block by itself,
so the answers with one are made by a grammar naming the tag tokens (a Lark grammar's
`<[id]>`)."""
from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from openai.types.chat import ChatCompletion
from openai.types.responses import Response
from transformers import AutoTokenizer

from cli import main
from cli_helpers import FAST
from cluster import write_jsonl
from jobs.ledger import list_jobs
from jobs.results.openai_output import RESPONSES, output_line
from reasoning_helpers import R1_CHAT_TEMPLATE, make_tiny_qwen3

ASK = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, bundled_model_dir):
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3-thinking"), bundled_model_dir)


@pytest.fixture(scope="module")
def r1_dir(tmp_path_factory, bundled_model_dir):
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny-r1"), bundled_model_dir, R1_CHAT_TEMPLATE)


def run_job(runner, model_dir, tmp_path, Session, lines: list[dict]) -> tuple[str, dict[str, dict]]:
    """`pipeline run` of the lines on the model: the job's id and its rows by id (and /choice after the first)."""
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    result = runner.invoke(main, ["run", str(src), "--model", str(model_dir), *FAST])
    assert result.exit_code == 0, result.output
    with Session() as s:
        job = max(list_jobs(s), key=lambda j: j.created_at)
    table = pq.read_table(job.results_path)
    assert table.schema.field("reasoning").type == "string" and table.schema.field("reasoning_tokens").type == "int32"
    return job.id, {row["id"] + (f"/{row['choice']}" if row["choice"] else ""): row for row in table.to_pylist()}


def openai_lines(runner, job_id: str, tmp_path) -> dict[str, dict]:
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    result = runner.invoke(main, ["results", job_id, "--format", "openai", "--output-file", str(out),
                                  "--error-file", str(err)])
    assert result.exit_code == 0, result.output
    return {line["custom_id"]: line for line in map(json.loads, out.read_text().splitlines())}


def chat(custom_id: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": ASK, "max_tokens": 6, "temperature": 0, **body}}


def forced(text_before: str, text_after: str, ids: dict) -> dict:
    """A Lark grammar making the answer `<think>`, text_before, `</think>`, text_after."""
    return {"grammar": f'start: <[{ids["<think>"]}]> {json.dumps(text_before)} <[{ids["</think>"]}]> '
                       f'{json.dumps(text_after)}'}


def test_reasoning_effort_switches_qwen3_thinking_and_the_think_block_is_split(runner, data_root, tmp_path,
                                                                               Session, qwen3_dir):
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    ids = {tag: tokenizer.convert_tokens_to_ids(tag) for tag in ("<think>", "</think>")}
    job_id, rows = run_job(runner, qwen3_dir, tmp_path, Session, [
        chat("off", reasoning_effort="none"),
        chat("high", reasoning_effort="high"),
        chat("default"),
        chat("thought", reasoning_effort="low", max_tokens=64, logprobs=True,
             structured_outputs=forced("\nThe air scatters blue light.\n", "\n\nRayleigh.", ids)),
        chat("cut", max_tokens=3, structured_outputs=forced("\nthinking on and on", "never", ids)),
        chat("two", n=2, temperature=1, seed=3, max_tokens=32, structured_outputs=forced("Hm.", "Yes.", ids)),
    ])
    # Thinking off: Qwen3's template closes an empty think block in the prompt, 4 tokens more
    # (<think>, "\n\n", </think>, "\n\n"); high is the template's default, thinking on.
    assert rows["off"]["prompt_tokens"] == rows["high"]["prompt_tokens"] + 4
    assert rows["high"]["prompt_tokens"] == rows["default"]["prompt_tokens"]
    for name in ("off", "high", "default"):   # the random model opened no think block: all answer
        assert rows[name]["reasoning"] is None and rows[name]["reasoning_tokens"] == 0
        assert rows[name]["output_tokens"] == 6 and rows[name]["output"]

    thought = rows["thought"]
    assert thought["valid"] is True and thought["finish_reason"] == "stop"
    assert (thought["reasoning"], thought["output"]) == ("The air scatters blue light.", "Rayleigh.")
    # <think>, the reasoning's tokens, </think>: the answer's tokens are the rest. Logprobs stay
    # one per output token, think tokens included.
    tokens = [entry["token"] for entry in thought["logprobs"]]
    assert len(tokens) == thought["output_tokens"] and tokens[0] == "<think>"
    assert thought["reasoning_tokens"] == tokens.index("</think>") + 1 < thought["output_tokens"]
    for name in ("two", "two/1"):   # every choice of a request is split
        assert (rows[name]["reasoning"], rows[name]["output"]) == ("Hm.", "Yes.")
    cut = rows["cut"]   # max_tokens before </think>: all reasoning, no answer (as vLLM)
    assert cut["finish_reason"] == "length" and cut["output"] == ""
    assert cut["reasoning_tokens"] == cut["output_tokens"] == 3
    assert cut["reasoning"] and "thinking on and on".startswith(cut["reasoning"])

    lines = openai_lines(runner, job_id, tmp_path)
    body = ChatCompletion.model_validate(lines["thought"]["response"]["body"])
    message = body.choices[0].message
    assert message.content == "Rayleigh." and message.model_extra["reasoning_content"] == thought["reasoning"]
    assert body.usage.completion_tokens_details.reasoning_tokens == thought["reasoning_tokens"]
    assert body.usage.completion_tokens == thought["output_tokens"]
    plain = ChatCompletion.model_validate(lines["off"]["response"]["body"])
    assert "reasoning_content" not in plain.choices[0].message.model_extra
    assert plain.usage.completion_tokens_details.reasoning_tokens == 0
    cut_body = ChatCompletion.model_validate(lines["cut"]["response"]["body"])
    assert cut_body.choices[0].message.content == "" and cut_body.choices[0].finish_reason == "length"
    # The same row as a /v1/responses answer: a reasoning item before the message, as OpenAI's
    line = output_line(thought, endpoint=RESPONSES, model="m", created=0)
    response = Response.model_validate(line["response"]["body"])
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == thought["reasoning"]
    assert message.content[0].text == "Rayleigh." and response.output_text == "Rayleigh."
    assert response.usage.output_tokens_details.reasoning_tokens == thought["reasoning_tokens"]


def test_a_prompt_that_opens_the_think_block_deepseek_r1_style(runner, data_root, tmp_path, Session, r1_dir):
    tokenizer = AutoTokenizer.from_pretrained(r1_dir)
    end = tokenizer.convert_tokens_to_ids("</think>")
    _, rows = run_job(runner, r1_dir, tmp_path, Session, [
        {"id": "closed", "messages": ASK, "max_tokens": 20, "temperature": 0, "logprobs": 0,
         "structured_outputs": {"grammar": f'start: "Short." <[{end}]> "Answer."'}},
        {"id": "open", "messages": ASK, "max_tokens": 4, "temperature": 0, "logit_bias": {str(end): -100},
         "reasoning_effort": "none"},   # R1's template has no switch: taken and ignored
        {"id": "raw", "prompt": "<think>\nno split for a raw prompt", "max_tokens": 4, "temperature": 0},
    ])
    assert (rows["closed"]["reasoning"], rows["closed"]["output"]) == ("Short.", "Answer.")
    tokens = [entry["token"] for entry in rows["closed"]["logprobs"]]
    assert rows["closed"]["reasoning_tokens"] == tokens.index("</think>") + 1 < len(tokens)
    assert rows["open"]["output"] == "" and rows["open"]["reasoning_tokens"] == 4 and rows["open"]["reasoning"]
    assert rows["raw"]["reasoning"] is None and rows["raw"]["reasoning_tokens"] is None and rows["raw"]["output"]


def test_a_model_whose_template_does_not_think_is_left_whole(runner, data_root, tmp_path, Session, tiny_model_dir):
    _, rows = run_job(runner, tiny_model_dir, tmp_path, Session, [
        {"id": "none", "messages": ASK, "max_tokens": 4, "temperature": 0, "reasoning_effort": "none"},
        {"id": "high", "messages": ASK, "max_tokens": 4, "temperature": 0, "reasoning_effort": "high"},
    ])
    # SmolLM2's template reads no switch: the same prompt, answers untouched, the columns null
    assert rows["none"]["prompt_tokens"] == rows["high"]["prompt_tokens"]
    assert rows["none"]["output"] == rows["high"]["output"]
    assert all(row["reasoning"] is None and row["reasoning_tokens"] is None for row in rows.values())
