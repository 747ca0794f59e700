"""Helpers of the input-validation tests (test_spec, test_line_errors): input files written
from their lines, and what validation makes of them."""
from __future__ import annotations

import json

from jobs.input.line_checks import Limits, RequestSpec, iter_lines, validate

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def write(tmp_path, lines, name="input.jsonl") -> str:
    """Write lines (dicts become JSON, str/bytes are written as they are) one a line."""
    path = tmp_path / name
    with open(path, "wb") as f:
        for line in lines:
            if isinstance(line, dict):
                line = json.dumps(line)
            f.write((line.encode() if isinstance(line, str) else line) + b"\n")
    return str(path)


def batch_line(custom_id, body, url=CHAT, method="POST") -> dict:
    return {"custom_id": custom_id, "method": method, "url": url, "body": body}


def chat_body(**extra) -> dict:
    return {"model": "gpt-x", "messages": [{"role": "user", "content": "hi"}], **extra}


def errors_by_line(path, limits=Limits()) -> dict[int | None, str]:
    v = validate(path, limits)
    assert v.num_errors == len(v.errors)
    return {e.line: e.message for e in v.errors}


def specs(path, limits=Limits()) -> list[RequestSpec]:
    items = [item for _, item in iter_lines(path, limits)]
    assert all(isinstance(i, RequestSpec) for i in items), items
    return items
