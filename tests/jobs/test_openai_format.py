"""OpenAI Batch shapes (jobs.results.openai_output), validated against the openai package's own types."""
from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest
from openai.types import Batch, Completion, CreateEmbeddingResponse
from openai.types.chat import ChatCompletion
from openai.types.responses import Response
from openai.types.responses.response import IncompleteDetails

from jobs.results.openai_output import batch_object, is_error_line, output_line, write_openai_files

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
T0 = datetime(2025, 1, 2, 3, 4, 5, tzinfo=timezone.utc)


def row(id="r1", output="Hello there", finish_reason="stop", error=None, prompt_tokens=5, output_tokens=3,
        cached_tokens=0):
    return {"id": id, "output": output, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
            "cached_tokens": cached_tokens,
            "finish_reason": finish_reason, "error": error, "queue_s": 0.1, "ttft_s": 0.2,
            "latency_s": 0.5, "shard": 0, "attempt": 1}


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_chat_output_line_validates(finish):
    line = output_line(row(finish_reason=finish, cached_tokens=4), endpoint=CHAT, model="smol", created=1700000000)
    assert line["custom_id"] == "r1" and line["error"] is None and line["id"].startswith("batch_req_")
    assert line["response"]["status_code"] == 200 and line["response"]["request_id"]
    body = ChatCompletion.model_validate(line["response"]["body"])
    assert body.object == "chat.completion" and body.id.startswith("chatcmpl-")
    assert (body.created, body.model) == (1700000000, "smol")
    (choice,) = body.choices
    assert (choice.index, choice.finish_reason, choice.logprobs) == (0, finish, None)
    assert (choice.message.role, choice.message.content) == ("assistant", "Hello there")
    assert (body.usage.prompt_tokens, body.usage.completion_tokens, body.usage.total_tokens) == (5, 3, 8)
    assert body.usage.prompt_tokens_details.cached_tokens == 4
    assert set(line["response"]["body"]) <= set(ChatCompletion.model_fields)
    assert set(line["response"]["body"]["choices"][0]) <= set(type(choice).model_fields)
    assert not is_error_line(line)
    json.dumps(line)  # the line must be plain JSON


def test_completion_output_line_validates():
    line = output_line(row(output="", finish_reason="length"), endpoint=COMPLETIONS, model="m", created=7)
    body = Completion.model_validate(line["response"]["body"])
    assert body.object == "text_completion" and body.id.startswith("cmpl-")
    (choice,) = body.choices
    assert (choice.text, choice.finish_reason, choice.index) == ("", "length", 0)
    assert set(line["response"]["body"]) <= set(Completion.model_fields)
    assert (body.usage.prompt_tokens, body.usage.completion_tokens, body.usage.total_tokens) == (5, 3, 8)
    assert body.usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.parametrize("finish,code", [("error", "request_failed"), ("cancelled", "batch_cancelled")])
def test_error_lines(finish, code):
    err = "prompt is longer than the model's context" if finish == "error" else None
    line = output_line(row(output="", finish_reason=finish, error=err), endpoint=CHAT, model="m", created=1)
    assert line["response"] is None and is_error_line(line)
    assert line["custom_id"] == "r1" and line["error"]["code"] == code
    assert line["error"]["message"] == (err or "the request was cancelled")


def test_ids_are_deterministic_and_distinct():
    a = output_line(row(), endpoint=CHAT, model="m", created=1)
    assert a == output_line(row(), endpoint=CHAT, model="m", created=1)
    b = output_line(row(id="r2"), endpoint=CHAT, model="m", created=1)
    c = output_line(row(output="other"), endpoint=CHAT, model="m", created=1)
    ids = {x["id"] for x in (a, b, c)} | {x["response"]["body"]["id"] for x in (a, b, c)}
    assert len(ids) == 6


def test_unknown_endpoint_and_finish_reason_are_refused():
    with pytest.raises(ValueError, match="endpoint"):
        output_line(row(), endpoint="/v1/moderations", model="m", created=1)
    with pytest.raises(ValueError, match="finish_reason"):
        output_line(row(finish_reason="weird"), endpoint=CHAT, model="m", created=1)


def test_write_openai_files_splits(tmp_path):
    rows = [row(id="a"), row(id="b", finish_reason="error", error="boom"), row(id="c", finish_reason="length"),
            row(id="d", finish_reason="cancelled")]
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    assert write_openai_files(iter(rows), out, err, endpoint=CHAT, model="m", created=3) == (2, 2)
    ok_lines = [json.loads(x) for x in out.read_text().splitlines()]
    err_lines = [json.loads(x) for x in err.read_text().splitlines()]
    assert [x["custom_id"] for x in ok_lines] == ["a", "c"]
    assert [x["custom_id"] for x in err_lines] == ["b", "d"]
    assert all(not is_error_line(x) for x in ok_lines) and all(is_error_line(x) for x in err_lines)
    assert ok_lines[0] == output_line(rows[0], endpoint=CHAT, model="m", created=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["err.jsonl", "out.jsonl"]  # no temp files left


def test_write_openai_files_leaves_nothing_on_failure(tmp_path):
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    with pytest.raises(ValueError):
        write_openai_files([row(), row(finish_reason="bogus")], out, err, endpoint=CHAT, model="m", created=3)
    assert list(tmp_path.iterdir()) == []


def job(status, **extra):
    base = {"id": "job_0123456789abcdef", "status": status, "endpoint": CHAT,
            "input_path": "/data/jobs/job_0123456789abcdef/input.jsonl",
            "results_path": "/data/jobs/job_0123456789abcdef/results", "created_at": T0,
            "started_at": None, "finished_at": None, "total": 10, "completed": 0, "failed": 0,
            "prompt_tokens": 0, "output_tokens": 0, "error": None, "completion_window": "24h",
            "metadata": None}
    return {**base, **extra}


NOW = (T0 + timedelta(hours=1)).timestamp()
CASES = {
    "queued": job("queued"),
    "in_progress": job("in_progress", started_at=T0 + timedelta(seconds=5), completed=4, failed=1,
                       prompt_tokens=100, output_tokens=40),
    "finalizing": job("finalizing", started_at=T0, finalizing_at=T0 + timedelta(minutes=9)),
    "completed": job("completed", started_at=T0, finished_at=T0 + timedelta(minutes=10), completed=9,
                     failed=1, prompt_tokens=1000, output_tokens=300, cached_tokens=640, metadata={"team": "a"}),
    "failed": job("failed", finished_at=T0 + timedelta(seconds=2),
                  error="2 error(s) in the input file:\nline 3: invalid JSON\nline 9: duplicate id 'a'"),
    "cancelling": job("cancelling", started_at=T0, cancelling_at=T0 + timedelta(minutes=1)),
    "cancelled": job("cancelled", started_at=T0, cancelling_at=T0 + timedelta(minutes=1),
                     finished_at=T0 + timedelta(minutes=2)),
    "expired": job("expired", expires_at=T0 + timedelta(minutes=30)),
    "past_expiry": job("in_progress", started_at=T0, expires_at=T0 + timedelta(minutes=30)),
    "completed_after_expiry": job("completed", finished_at=T0, expires_at=T0 + timedelta(minutes=30)),
    "no_endpoint": job("queued", endpoint=None, completion_window=None,
                       created_at=datetime(2025, 1, 2, 3, 4, 5)),  # naive: UTC
}
EXPECTED_STATUS = {"queued": "in_progress", "in_progress": "in_progress",
                   "finalizing": "finalizing", "completed": "completed", "failed": "failed",
                   "cancelling": "cancelling", "cancelled": "cancelled", "expired": "expired",
                   "past_expiry": "expired", "completed_after_expiry": "completed", "no_endpoint": "in_progress"}


@pytest.mark.parametrize("case", list(CASES))
def test_batch_object_validates(case):
    obj = batch_object(CASES[case], now=NOW)
    batch = Batch.model_validate(obj)
    assert batch.status == EXPECTED_STATUS[case]
    assert batch.object == "batch" and batch.id == "job_0123456789abcdef"
    assert batch.created_at == int(T0.timestamp())
    assert batch.request_counts.total == 10
    assert batch.usage.total_tokens == batch.usage.input_tokens + batch.usage.output_tokens
    # Nothing we send is dropped by the model: every key is a Batch field.
    assert set(obj) <= set(Batch.model_fields)
    json.dumps(obj)


def test_batch_object_fields():
    done = Batch.model_validate(batch_object(CASES["completed"], now=NOW))
    assert done.completed_at == int((T0 + timedelta(minutes=10)).timestamp())
    assert (done.request_counts.completed, done.request_counts.failed) == (9, 1)
    assert (done.usage.input_tokens, done.usage.output_tokens, done.usage.total_tokens) == (1000, 300, 1300)
    assert done.usage.input_tokens_details.cached_tokens == 640
    assert done.metadata == {"team": "a"} and done.endpoint == CHAT and done.completion_window == "24h"
    assert done.output_file_id == "/data/jobs/job_0123456789abcdef/results"

    failed = Batch.model_validate(batch_object(CASES["failed"], now=NOW))
    assert failed.failed_at == int(T0.timestamp()) + 2 and failed.completed_at is None
    assert [(e.line, e.message) for e in failed.errors.data] == [
        (None, "2 error(s) in the input file:"), (3, "invalid JSON"), (9, "duplicate id 'a'")]

    expired = Batch.model_validate(batch_object(CASES["past_expiry"], now=NOW))
    assert expired.expired_at == expired.expires_at == int((T0 + timedelta(minutes=30)).timestamp())
    live = Batch.model_validate(batch_object(CASES["past_expiry"], now=T0.timestamp()))
    assert live.status == "in_progress" and live.expired_at is None and live.in_progress_at == int(T0.timestamp())

    cancelled = Batch.model_validate(batch_object(CASES["cancelled"], now=NOW))
    assert cancelled.cancelled_at - cancelled.cancelling_at == 60

    plain = Batch.model_validate(batch_object(CASES["no_endpoint"], now=NOW))
    assert plain.endpoint == COMPLETIONS and plain.completion_window == "24h" and plain.errors is None


def test_batch_object_rejects_unknown_status():
    with pytest.raises(ValueError, match="status"):
        batch_object(job("paused"))


def test_embedding_output_line_validates_with_floats_and_base64():
    import base64
    import struct
    vectors = [[0.6, -0.8, 0.0], [1.0, 0.0, 0.0]]
    rows = [{**row(id="e", output="", output_tokens=0, prompt_tokens=4 + i), "choice": i, "embedding": v,
             "encoding_format": fmt} for i, (v, fmt) in enumerate(zip(vectors, [None, "base64"]))]
    line = output_line(rows, endpoint="/v1/embeddings", model="minilm", created=1)
    raw = line["response"]["body"]["data"][1]["embedding"]   # openai's type holds floats: its client decodes base64
    assert isinstance(raw, str) and list(struct.unpack("<3f", base64.b64decode(raw))) == vectors[1]
    line["response"]["body"]["data"][1]["embedding"] = vectors[1]
    body = CreateEmbeddingResponse.model_validate(line["response"]["body"])
    assert (body.object, body.model, body.usage.prompt_tokens, body.usage.total_tokens) == ("list", "minilm", 9, 9)
    assert [d.index for d in body.data] == [0, 1] and body.data[0].embedding == vectors[0]
    failed = output_line([{**rows[0], "finish_reason": "error", "error": "too long", "embedding": None}],
                         endpoint="/v1/embeddings", model="m", created=1)
    assert failed["response"] is None and failed["error"]["message"] == "too long"


RESPONSES = "/v1/responses"
ENTRY = {"token": "No", "logprob": -0.5, "bytes": [78, 111],
         "top_logprobs": [{"token": "No", "logprob": -0.5, "bytes": [78, 111]},
                          {"token": "Yes", "logprob": -1.0, "bytes": [89, 101, 115]}]}


@pytest.mark.parametrize("finish,status", [("stop", "completed"), ("length", "incomplete")])
def test_responses_output_line_is_a_response_with_the_answer_or_the_forced_call(finish, status):
    line = output_line({**row(finish_reason=finish, cached_tokens=2), "logprobs": [ENTRY]}, endpoint=RESPONSES,
                       model="gpt-4o-mini", created=7)
    body = Response.model_validate(line["response"]["body"])
    assert set(line["response"]["body"]) <= set(Response.model_fields)
    assert (body.object, body.created_at, body.model, body.status) == ("response", 7, "gpt-4o-mini", status)
    assert body.id.startswith("resp_") and body.output_text == "Hello there" and body.error is None
    assert body.incomplete_details == (None if finish == "stop" else IncompleteDetails(reason="max_output_tokens"))
    (message,) = body.output
    assert (message.type, message.role, message.status, message.id[:4]) == ("message", "assistant", status, "msg_")
    (text,) = message.content
    assert [(p.token, p.logprob, [t.token for t in p.top_logprobs]) for p in text.logprobs] == [
        ("No", -0.5, ["No", "Yes"])]
    usage = body.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (5, 3, 8)
    assert (usage.input_tokens_details.cached_tokens, usage.output_tokens_details.reasoning_tokens) == (2, 0)

    call = output_line({**row(output='{"city": "Paris"}', finish_reason=finish), "tool_call": "get_weather"},
                       endpoint=RESPONSES, model="m", created=7)
    body = Response.model_validate(call["response"]["body"])
    (item,) = body.output
    assert (item.type, item.name, json.loads(item.arguments), item.status) == (
        "function_call", "get_weather", {"city": "Paris"}, status)
    assert item.call_id.startswith("call_") and body.output_text == ""
    assert body.tool_choice.name == "get_weather"


def test_a_failed_response_is_an_error_line_and_a_response_has_one_answer():
    line = output_line(row(output="", finish_reason="error", error="too long"), endpoint=RESPONSES, model="m",
                       created=1)
    assert line["response"] is None and line["error"] == {"code": "request_failed", "message": "too long"}
    with pytest.raises(ValueError, match="one answer"):
        output_line([{**row(), "choice": 0}, {**row(), "choice": 1}], endpoint=RESPONSES, model="m", created=1)
