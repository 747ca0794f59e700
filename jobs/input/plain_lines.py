"""The common request lines, checked at C speed.

Most lines of a large file are plain: a prompt or chat messages, an id, a few sampling
settings. For those, msgspec checks every field's type and range in one call (the parsed
line converted into a Struct) instead of a Python check a field (jobs.input.field_checks),
which halves the time a 1,000,000-line submit spends on each line.

The Structs take their ranges from those same checks (each one's `.type`), and a line they
do not take whole (any other field, a value out of range, a string to look at more closely,
the first line of a file) returns None: the full checks then name its problems. So this
path only ever accepts, and what it accepts the full checks accept as the same request line
(tests/jobs/test_plain_lines.py compares the two on generated lines).
"""
from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from jobs.input.field_checks import CHAT_ENDPOINT, CHAT_ROLES, SAMPLING_CHECKS, SAMPLING_DEFAULTS, TIMEOUT_CHECK
from jobs.input.request_spec import OPTIONAL_FIELDS, request_line

_Message = msgspec.defstruct("PlainMessage", [("role", Literal[CHAT_ROLES]), ("content", str)],
                             forbid_unknown_fields=True)
_Messages = Annotated[list[_Message], Meta(min_length=1)]
# The sampling settings a Struct can check whole (logit_bias is left to the full check), with
# their defaults: a null given for one is left to the full checks too (it means the default).
_SAMPLING = [(name, check.type, msgspec.field(default_factory=list) if name == "stop" else SAMPLING_DEFAULTS[name])
             for name, check in SAMPLING_CHECKS.items() if hasattr(check, "type")]

_PipelineLine = msgspec.defstruct(
    "PlainPipelineLine",
    [("id", str | None, None), ("prompt", str | None, None), ("messages", _Messages | None, None),
     ("timeout_s", TIMEOUT_CHECK.type | None, None), *_SAMPLING],
    forbid_unknown_fields=True)
_OpenAILine = msgspec.defstruct("PlainOpenAILine", [("custom_id", str), ("method", Literal["POST"]), ("url", str),
                                                    ("body", dict)], forbid_unknown_fields=True)
_max_tokens = SAMPLING_CHECKS["max_tokens"].type | None
# max_tokens None: not given (max_completion_tokens may say it instead)
_BODY_SAMPLING = [("max_tokens", _max_tokens, None) if name == "max_tokens" else (name, kind, default)
                  for name, kind, default in _SAMPLING]
_ChatBody = msgspec.defstruct("PlainChatBody", [("messages", _Messages), ("model", str | None, None),
                                                ("max_completion_tokens", _max_tokens, None), *_BODY_SAMPLING],
                              forbid_unknown_fields=True)
_CompletionBody = msgspec.defstruct("PlainCompletionBody", [("prompt", str), ("model", str | None, None),
                                                            ("max_completion_tokens", _max_tokens, None),
                                                            *_BODY_SAMPLING],
                                    forbid_unknown_fields=True)


def _text_ok(s: str, max_chars: int) -> bool:
    """A non-empty string within max_chars that UTF-8 can carry (no lone surrogate)."""
    return 0 < len(s) <= max_chars and _utf8(s)


def _utf8(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class PlainLines:
    """Request lines of a file's plain lines (None for any other), given the file's limits
    and the names its model may be called by (None: any)."""

    def __init__(self, max_id_chars: int, max_prompt_chars: int, model_names: tuple[str, ...] | None):
        self.max_id_chars, self.max_prompt_chars, self.model_names = max_id_chars, max_prompt_chars, model_names

    def pipeline(self, number: int, obj: dict) -> dict | None:
        """A pipeline-format generation line (its id None when it gives none)."""
        try:
            checked = msgspec.convert(obj, _PipelineLine)
        except msgspec.ValidationError:
            return None
        line = _given(obj, checked)
        if (line["prompt"] is None) == (line["messages"] is None) or (
                line["id"] is not None and not _text_ok(line["id"], self.max_id_chars)):
            return None
        return self._line(number, line, None)

    def openai(self, number: int, obj: dict, endpoint: str) -> dict | None:
        """An OpenAI batch line of the file's endpoint (chat or completions)."""
        try:
            s = msgspec.convert(obj, _OpenAILine)
            if s.url != endpoint:
                return None
            body = s.body
            checked = msgspec.convert(body, _ChatBody if endpoint == CHAT_ENDPOINT else _CompletionBody)
        except msgspec.ValidationError:
            return None
        line = _given(body, checked)
        model, most = line.pop("model", None), line.pop("max_completion_tokens", None)
        if not _text_ok(s.custom_id, self.max_id_chars) or model is not None and not (
                _text_ok(model, self.max_id_chars) and (self.model_names is None or model in self.model_names)):
            return None
        if most is not None:
            if body.get("max_tokens") is not None:
                return None
            line["max_tokens"] = most
        line["id"] = s.custom_id
        return self._line(number, line, model)

    def _line(self, number: int, line: dict, model: str | None) -> dict | None:
        """Check what the Struct left (lengths, UTF-8) and complete the request line."""
        prompt, messages, stop = line["prompt"], line["messages"], line["stop"]
        if prompt is not None and not _text_ok(prompt, self.max_prompt_chars):
            return None
        if messages is not None:
            if sum(len(m.content) for m in messages) > self.max_prompt_chars or not all(_utf8(m.content)
                                                                                          for m in messages):
                return None
            line["messages"] = [{"role": m.role, "content": m.content} for m in messages]
        if stop.__class__ is str:
            line["stop"] = stop = [stop]
        if not all(_utf8(x) for x in stop):
            return None
        line["line"] = number
        if model is not None:
            line["model"] = model
        return request_line(line, _PLAIN_OPTIONAL)


# What a plain line's request line holds before the fields it gives: every required field at
# its default (stop made afresh for each line).
_BASE = {"id": None, "prompt": None, "messages": None,
         **{name: default for name, default in SAMPLING_DEFAULTS.items() if name not in OPTIONAL_FIELDS}}
# The optional fields a plain line may give (only kept when not at their default).
_PLAIN_OPTIONAL = tuple((name, OPTIONAL_FIELDS[name]) for name in ("timeout_s", *SAMPLING_DEFAULTS)
                        if name in OPTIONAL_FIELDS and name != "logit_bias")


def _given(obj: dict, checked) -> dict:
    """The request line's fields so far: the defaults, and the values the line gives as checked
    (an integer given for a float setting is the float)."""
    line = dict(_BASE)
    line["stop"] = []
    for name in obj:
        if (value := getattr(checked, name)) is not None:   # null: the default (the Struct lets only some be null)
            line[name] = value
    return line
