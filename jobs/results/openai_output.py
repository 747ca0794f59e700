"""OpenAI Batch API shapes: batch output lines built from result rows, and the Batch object.

Pure functions over plain dicts (result rows of docs/contracts.md, job dicts from the
ledger); only write_openai_files touches the file system. The shapes match the types of
the `openai` package (Batch, ChatCompletion, Completion, CreateEmbeddingResponse, Response),
which the tests validate against.
"""
from __future__ import annotations

import base64
import hashlib
import itertools
import json
import re
import struct
import time
from datetime import datetime, timezone
from typing import Iterable

from jobs.atomic_files import TargetRefused, atomic_write, check_target, same_target
from jobs.input.field_checks import CHAT_ENDPOINT, COMPLETIONS_ENDPOINT, EMBEDDINGS_ENDPOINT, RESPONSES_ENDPOINT
from jobs.scheduling import error_code
from jobs.ledger.statuses import JobStatus
from pipeline.request import FinishReason

CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES = CHAT_ENDPOINT, COMPLETIONS_ENDPOINT, EMBEDDINGS_ENDPOINT, RESPONSES_ENDPOINT
# Batch.endpoint is a plain str in the openai types, so any value validates. A pipeline-format
# job has no OpenAI endpoint; it is reported as /v1/completions, the generic text endpoint.
PIPELINE_ENDPOINT = COMPLETIONS

# Our job statuses onto Batch.status. OpenAI has no "queued": a validated batch waiting for
# capacity is reported "in_progress" there, so ours is too. The rest exist in both.
# "expiring" (ours) is a job wrapping up after its window passed: OpenAI's "finalizing"
# (batch_object reports any unfinished job past its expires_at as "expired" anyway).
_STATUS = {status.value: status.value for status in JobStatus} | {
    JobStatus.QUEUED.value: JobStatus.IN_PROGRESS.value, JobStatus.EXPIRING.value: JobStatus.FINALIZING.value}
_FINISHED = {status.value for status in JobStatus.terminal()}
_SUCCESSES = {reason.value for reason in FinishReason if reason.is_success}
_ERROR_CODES = {FinishReason.ERROR: "request_failed", FinishReason.CANCELLED: "batch_cancelled",
                FinishReason.TIMEOUT: "request_timeout"}
_LINE_ERROR = re.compile(r"line (\d+): (.*)")


def output_line(rows: dict | list[dict], *, endpoint: str, model: str, created: int) -> dict:
    """The batch output line of one request: its result row, or the rows of its n choices (in
    choice order). A response body holding every choice, or an error when a choice failed.
    The body's model is the name the line used (its row's model), else `model` (the job's).

    Ids are hashes of the rows' ids and outcomes, so exporting the same results twice gives
    the same file.
    """
    rows = [rows] if isinstance(rows, dict) else rows
    first = rows[0]
    outcomes = [[r["id"], r.get("output"), r.get("error"), r["finish_reason"]] for r in rows]
    digest = hashlib.sha256(json.dumps(outcomes[0] if len(rows) == 1 else outcomes,
                                       ensure_ascii=False).encode()).hexdigest()
    line = {"id": f"batch_req_{digest[:32]}", "custom_id": first["id"]}
    for row in rows:
        finish = row["finish_reason"]
        if finish in _ERROR_CODES:   # a request is answered whole or not at all, as OpenAI's are
            message = row.get("error") or f"the request was {finish}"
            code = error_code(row.get("error")) or _ERROR_CODES[finish]
            return {**line, "response": None, "error": {"code": code, "message": message}}
        if finish not in _SUCCESSES:
            raise ValueError(f"row {row['id']!r}: unknown finish_reason {finish!r}")
    body = _body(rows, digest, endpoint=endpoint, model=first.get("model") or model, created=created)
    return {**line, "response": {"status_code": 200, "request_id": digest[32:64], "body": body}, "error": None}


def _logprobs(entries: list[dict] | None, endpoint: str) -> dict | None:
    """A row's token logprobs in the endpoint's shape: chat's {"content": [...]}, or the
    completions' parallel lists (tokens, token_logprobs, top_logprobs, text_offset)."""
    if entries is None:
        return None
    if endpoint == CHAT:
        return {"content": entries, "refusal": None}
    offsets, at = [], 0
    for entry in entries:
        offsets.append(at)
        at += len(entry["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [None if e["top_logprobs"] is None else {t["token"]: t["logprob"] for t in e["top_logprobs"]}
                             for e in entries],   # None: an echoed prompt's first token
            "text_offset": offsets}


def _body(rows: list[dict], digest: str, *, endpoint: str, model: str, created: int) -> dict:
    """The response body: each prompt counted once (a request's n choices share one; a list of
    prompts has a first row each), the completion tokens of every choice."""
    if endpoint == EMBEDDINGS:
        return _embeddings_body(rows, model)
    if endpoint == RESPONSES:
        return _response_body(rows, digest, model=model, created=created)
    first_of: dict[int | None, dict] = {}   # prompt index (None: the one prompt) -> its first row
    for row in rows:
        first_of.setdefault(row.get("prompt_index"), row)
    firsts = first_of.values()
    prompt_tokens = sum(int(row["prompt_tokens"]) for row in firsts)
    completion_tokens = sum(int(r["output_tokens"]) for r in rows)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens,
             "prompt_tokens_details": {"cached_tokens": sum(int(row.get("cached_tokens") or 0) for row in firsts)}}
    thought = [row["reasoning_tokens"] for row in rows if row.get("reasoning_tokens") is not None]
    if thought:   # a thinking model's answers (pipeline.reasoning): its think blocks' tokens
        usage["completion_tokens_details"] = {"reasoning_tokens": sum(map(int, thought))}
    choices = [_choice(row, digest, endpoint) for row in rows]
    if endpoint == CHAT:
        return {"id": f"chatcmpl-{digest[:29]}", "object": "chat.completion", "created": created,
                "model": model, "choices": choices, "usage": usage}
    return {"id": f"cmpl-{digest[:29]}", "object": "text_completion", "created": created,
            "model": model, "choices": choices, "usage": usage}


def _embeddings_body(rows: list[dict], model: str) -> dict:
    """A CreateEmbeddingResponse: a vector per input, as floats or as base64 of their float32
    bytes (little-endian, as OpenAI sends them); every input's tokens counted."""
    data = [{"object": "embedding", "index": row.get("choice") or 0,
             "embedding": _base64(row["embedding"]) if row.get("encoding_format") == "base64" else row["embedding"]}
            for row in rows]
    tokens = sum(int(row["prompt_tokens"]) for row in rows)
    return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _response_body(rows: list[dict], digest: str, *, model: str, created: int) -> dict:
    """A Response: one output item, the assistant's message (its logprobs when asked for) or
    the forced function call. An answer cut by max_output_tokens is "incomplete", as OpenAI
    reports it. The request's own settings (instructions, tools, temperature, ...) are not
    echoed back: result rows do not keep them."""
    if len(rows) != 1:
        raise ValueError(f"request {rows[0]['id']!r}: a response has one answer, got {len(rows)} rows")
    row = rows[0]
    status = "incomplete" if row["finish_reason"] == FinishReason.LENGTH else "completed"
    text = row["output"] or ""
    if row.get("tool_call"):
        item = {"type": "function_call", "id": f"fc_{digest[:32]}", "call_id": f"call_{digest[:24]}",
                "name": row["tool_call"], "arguments": text, "status": status}
        tool_choice = {"type": "function", "name": row["tool_call"]}
    else:
        item = {"type": "message", "id": f"msg_{digest[:32]}", "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [],
                             "logprobs": row.get("logprobs") or []}]}
        tool_choice = "auto"
    output = [item]
    if row.get("reasoning") is not None:   # a thinking model's think block, before the answer as OpenAI's
        output.insert(0, {"type": "reasoning", "id": f"rs_{digest[:32]}", "summary": [], "status": status,
                          "content": [{"type": "reasoning_text", "text": row["reasoning"]}]})
    input_tokens, output_tokens = int(row["prompt_tokens"]), int(row["output_tokens"])
    return {"id": f"resp_{digest[:32]}", "object": "response", "created_at": created, "status": status,
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": None, "metadata": None, "model": model, "output": output, "parallel_tool_calls": True,
            "temperature": None, "tool_choice": tool_choice, "tools": [], "top_p": None,
            "usage": {"input_tokens": input_tokens,
                      # cache writes are not metered (the prefix cache keeps what it computes unasked)
                      "input_tokens_details": {"cached_tokens": int(row.get("cached_tokens") or 0),
                                               "cache_write_tokens": 0},
                      "output_tokens": output_tokens,
                      "output_tokens_details": {"reasoning_tokens": int(row.get("reasoning_tokens") or 0)},
                      "total_tokens": input_tokens + output_tokens}}


def _base64(vector: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def _choice(row: dict, digest: str, endpoint: str) -> dict:
    if endpoint not in (CHAT, COMPLETIONS):
        raise ValueError(f"unknown endpoint {endpoint!r} (expected {CHAT} or {COMPLETIONS})")
    text = row["output"] or ""
    choice = {"index": row.get("choice") or 0, "finish_reason": row["finish_reason"],
              "logprobs": _logprobs(row.get("logprobs"), endpoint)}
    if endpoint == COMPLETIONS:
        choice["text"] = text
    elif row.get("tool_call"):   # a forced call: the output is its arguments
        if row["finish_reason"] == FinishReason.STOP:
            choice["finish_reason"] = "tool_calls"
        choice["message"] = {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{digest[:24]}" + (f"_{choice['index']}" if choice["index"] else ""), "type": "function",
             "function": {"name": row["tool_call"], "arguments": text}}]}
    else:
        choice["message"] = {"role": "assistant", "content": text}
    if endpoint == CHAT and row.get("reasoning") is not None:   # vLLM's field for the think block
        choice["message"]["reasoning_content"] = row["reasoning"]
    return choice


def is_error_line(line: dict) -> bool:
    """Whether a batch output line belongs in the error file."""
    return line.get("error") is not None


def write_openai_files(rows: Iterable[dict], output_path, error_path, *,
                       endpoint: str, model: str, created: int, overwrite: bool = False) -> tuple[int, int]:
    """Stream result rows into the batch output file (successes) and error file (failures), one
    line per request (the rows of a request's choices are consecutive, as a shard writes them).

    Both are written under temporary names and renamed at the end, so a reader never sees
    half a file. Returns (successes, errors). Before anything is written, raises
    jobs.atomic_files.TargetRefused if the two paths are one file or either is not a regular
    file, and TargetExists if either exists and overwrite is False.
    """
    if same_target(output_path, error_path):
        raise TargetRefused(f"the output file and the error file are the same file ({output_path}); "
                            "give two different paths")
    for path in (output_path, error_path):
        check_target(path, overwrite=overwrite)
    counts = [0, 0]
    with (atomic_write(output_path, overwrite=overwrite) as out,
          atomic_write(error_path, overwrite=overwrite) as err):
        for _, request_rows in itertools.groupby(rows, key=lambda row: row["id"]):   # its choices, in order
            line = output_line(list(request_rows), endpoint=endpoint, model=model, created=created)
            failed = is_error_line(line)
            (err if failed else out).write(json.dumps(line, ensure_ascii=False) + "\n")
            counts[failed] += 1
    return counts[0], counts[1]


def batch_object(job: dict, *, now: float | None = None) -> dict:
    """The OpenAI `Batch` object of a job (see the module's status mapping).

    A job whose expires_at has passed (at `now`, default the current time) and that is not
    finished is reported "expired". Naive datetimes are taken as UTC.
    """
    now = time.time() if now is None else now
    if job["status"] not in _STATUS:
        raise ValueError(f"job {job['id']}: unknown status {job['status']!r}")
    status = _STATUS[job["status"]]
    expires_at = _epoch(job.get("expires_at"))
    expired_at = _epoch(job.get("expired_at"))
    if status not in _FINISHED and expires_at is not None and expires_at <= now:
        status, expired_at = "expired", expires_at
    elif status == "expired" and expired_at is None:
        expired_at = expires_at
    finished = _epoch(job.get("finished_at"))
    input_tokens, output_tokens = job.get("prompt_tokens") or 0, job.get("output_tokens") or 0
    return {
        "id": job["id"],
        "object": "batch",
        "endpoint": job.get("endpoint") or PIPELINE_ENDPOINT,
        "model": job.get("model"),
        "status": status,
        "input_file_id": str(job["input_path"]),
        "output_file_id": str(job["results_path"]) if job.get("results_path") else None,
        "error_file_id": None,
        "completion_window": job.get("completion_window") or "24h",
        "created_at": _epoch(job["created_at"]),
        "in_progress_at": _epoch(job.get("started_at")),
        "finalizing_at": _epoch(job.get("finalizing_at")),
        "completed_at": finished if status == "completed" else None,
        "failed_at": _epoch(job.get("failed_at")) or (finished if status == "failed" else None),
        "cancelling_at": _epoch(job.get("cancelling_at")),
        "cancelled_at": _epoch(job.get("cancelled_at")) or (finished if status == "cancelled" else None),
        "expires_at": expires_at,
        "expired_at": expired_at,
        "request_counts": {"total": job.get("total") or 0, "completed": job.get("completed") or 0,
                           "failed": job.get("failed") or 0},
        "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens,
                  "total_tokens": input_tokens + output_tokens,
                  "input_tokens_details": {"cached_tokens": job.get("cached_tokens") or 0},
                  "output_tokens_details": {"reasoning_tokens": 0}},
        "errors": _errors(job.get("error")),
        "metadata": job.get("metadata"),
    }


def _errors(error: str | None) -> dict | None:
    """A job's error text as Batch.errors; "line N: ..." lines (from validation) keep their line."""
    if not error:
        return None
    data = []
    for text in error.splitlines():
        if m := _LINE_ERROR.fullmatch(text):
            data.append({"code": "invalid_request", "line": int(m[1]), "message": m[2]})
        elif text.strip():
            data.append({"code": "batch_failed", "message": text})
    return {"object": "list", "data": data}


def _epoch(value) -> int | None:
    """Integer Unix seconds of a datetime (naive = UTC) or a number; None stays None."""
    if value is None:
        return None
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return int(value.timestamp())
    return int(value)
