"""Checking the fields of one input request, and the sampling settings' defaults and ranges
(the prompt and chat messages: jobs.input.prompt_checks; the fields that shape the answer,
structured outputs, tools and logprobs: jobs.input.answer_shape_checks).

The ranges here are the ones a job's input must keep to (stricter than what the engine's
SamplingParams accepts); the defaults are SamplingParams' own, so they have one source.
Each check raises Bad with the message the user reads for that line.
"""
from __future__ import annotations

import math
from dataclasses import MISSING, fields
from typing import Annotated

from msgspec import Meta

from pipeline.sampling_params import SamplingParams

# The OpenAI endpoints a batch line may name: their one home (jobs.results.openai_output reads them).
CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"
EMBEDDINGS_ENDPOINT = "/v1/embeddings"   # its fields: jobs.input.embedding_checks
RESPONSES_ENDPOINT = "/v1/responses"     # read as the chat body it amounts to: jobs.input.responses_body
ENDPOINTS = (CHAT_ENDPOINT, COMPLETIONS_ENDPOINT, EMBEDDINGS_ENDPOINT, RESPONSES_ENDPOINT)
# The roles of the OpenAI chat format; a chat template given another may render it as text or fail.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
_OPENAI_INPUT_KEY = {CHAT_ENDPOINT: "messages", COMPLETIONS_ENDPOINT: "prompt"}
# The fields that shape the answer rather than sample it (checked in jobs.input.answer_shape_checks).
STRUCTURED_KEYS = ("response_format", "structured_outputs")
TOOL_KEYS = ("tools", "tool_choice", "parallel_tool_calls")
# Chat fields given to the chat template with the messages (jobs.input.prompt_checks).
TEMPLATE_KEYS = ("reasoning_effort",)
LOGPROB_KEYS = {CHAT_ENDPOINT: ("logprobs", "top_logprobs"), COMPLETIONS_ENDPOINT: ("logprobs", "echo")}
# OpenAI body fields that change nothing about the answer in a batch: taken and ignored
# (stream only when false, modalities only ["text"], both checked in openai_body). The
# prompt-cache hints ask for what the engine's prefix cache does unasked; safety_identifier
# is the newer `user`.
IGNORED_BODY_KEYS = frozenset({"user", "metadata", "store", "service_tier", "stream", "stream_options",
                               "modalities", "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention",
                               "safety_identifier"})
# Fields with another name here: a refusal says which.
_RENAMED = {"functions": "tools", "function_call": "tool_choice"}


MAX_CHOICES = 128   # n: answers to one request (its prompt computed once, its KV blocks shared)


class Bad(Exception):
    """One problem with one line; its message is what the user reads."""


def openai_body(endpoint: str, body: dict, max_model_chars: int, problems: list[str]):
    """Map an OpenAI request body onto our fields: (model, request fields, labels naming them in errors)."""
    key = _OPENAI_INPUT_KEY[endpoint]
    chat_only = {*TOOL_KEYS, *TEMPLATE_KEYS} if endpoint == CHAT_ENDPOINT else set()
    chat_only |= set(LOGPROB_KEYS[endpoint])
    if body.get("stream") not in (None, False):
        problems.append(f"unsupported field 'stream' = {describe(body['stream'])}: a batch writes its answers to "
                        "the results (leave stream out, or false)")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        problems.append(f"modalities: only [\"text\"] is supported, got {describe(modalities)}")
    best_of, n = (body.get("best_of") if endpoint == COMPLETIONS_ENDPOINT else None), body.get("n")
    if best_of is not None and (type(best_of) is not int or best_of != (1 if n is None else n)):
        problems.append(f"best_of = {describe(best_of)} is not supported: only best_of equal to n "
                        "(n answers, none picked among more)")
    # A null is the field's default, as if left out (clients that serialise every field send them).
    for k in sorted(k for k in body.keys() - _OPENAI_BODY_KEYS - chat_only - IGNORED_BODY_KEYS - {key}
                    if body[k] is not None and not (k == "best_of" and best_of is not None)):
        hint = f" in a {endpoint} body (use {key})" if k in _OPENAI_INPUT_KEY.values() else ""
        if k in _RENAMED and endpoint == CHAT_ENDPOINT:
            hint = f" (the legacy form of {_RENAMED[k]}: use tools and tool_choice)"
        problems.append(f"unsupported field {k!r}{hint}")
    if body.get(key) is None:
        problems.append(f"missing body.{key}")
    model = body.get("model")
    if model is not None:
        model = check(string, "model", model, max_model_chars, problems)
    req = {k: body[k] for k in (key, *SAMPLING_DEFAULTS, *STRUCTURED_KEYS, *LOGPROB_KEYS[endpoint],
                                *((*TOOL_KEYS, *TEMPLATE_KEYS) if endpoint == CHAT_ENDPOINT else ())) if k in body}
    labels = {}
    if body.get("max_completion_tokens") is not None:
        if body.get("max_tokens") is not None:
            problems.append("give max_tokens or max_completion_tokens, not both")
        req["max_tokens"], labels["max_tokens"] = body["max_completion_tokens"], "max_completion_tokens"
    return model, req, labels


def sampling_settings(req: dict, labels: dict, problems: list[str]) -> dict:
    """Checked sampling settings, defaults for absent or null ones; errors use the input's names."""
    out = dict(SAMPLING_DEFAULTS)
    out["stop"] = []   # never share the default list
    given = [key for key in req if key in _SAMPLING_ORDER]   # the line's few, not every setting
    if len(given) > 1:
        given.sort(key=_SAMPLING_ORDER.__getitem__)          # problems in one order, whatever the line's
    for key in given:
        value = req[key]
        if value is None:
            continue
        # A file's lines mostly repeat a few settings (temperature 0, max_tokens 256): each
        # distinct scalar is checked once, and its checked value taken from _CHECKED after.
        seen = (key, value.__class__, value) if value.__class__ in _SCALARS else None
        if seen is not None and (checked := _CHECKED.get(seen)) is not None:
            out[key] = checked
            continue
        out[key] = checked = check(SAMPLING_CHECKS[key], labels.get(key, key), value, None, problems)
        if seen is not None and checked.__class__ in _SCALARS and len(_CHECKED) < _CHECKED_MAX:
            _CHECKED[seen] = checked
    return out


_SCALARS = frozenset({int, float, bool, str})
_CHECKED: dict[tuple, object] = {}   # (setting, type, value) -> its checked value (only valid ones)
_CHECKED_MAX = 1 << 16


def request_timeout(req: dict, problems: list[str]) -> float | None:
    """A line's own timeout_s (seconds it may run once started), or None."""
    value = req.get("timeout_s")
    return None if value is None else check(TIMEOUT_CHECK, "timeout_s", value, None, problems)


def check(fn, name: str, value, arg, problems: list[str]):
    """Run one field check, turning its failure into a problem of the line."""
    try:
        return fn(name, value, arg)
    except Bad as e:
        problems.append(str(e))


def int_in(lo: int, hi: int | None):
    def check(name, v, _):
        if isinstance(v, bool) or not isinstance(v, int):
            raise Bad(f"{name} must be an integer, got {describe(v)}")
        if v < lo or (hi is not None and v > hi):
            allowed = f">= {lo}" if hi is None else f"between {lo} and {hi}"
            raise Bad(f"{name} must be {allowed}, got {v}")
        return v
    check.type = Annotated[int, Meta(ge=lo, le=hi)]   # the same range for msgspec (jobs.input.plain_lines)
    return check


def _float_in(lo: float, hi: float | None, allowed: str, *, open_lo: bool = False, open_hi: bool = False):
    def ok(x: float) -> bool:
        return (x > lo if open_lo else x >= lo) and (hi is None or (x < hi if open_hi else x <= hi))

    def check(name, v, _):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise Bad(f"{name} must be a number {allowed}, got {describe(v)}")
        try:
            x = float(v)   # a JSON integer of hundreds of digits overflows here
        except OverflowError:
            raise Bad(f"{name} must be a number {allowed}, got an integer of {len(str(v))} digits") from None
        if not math.isfinite(x) or not ok(x):
            raise Bad(f"{name} must be a number {allowed}, got {describe(v)}")
        return x
    check.type = Annotated[float, Meta(**{"gt" if open_lo else "ge": lo},
                                       **({} if hi is None else {"lt" if open_hi else "le": hi}))]
    return check


TIMEOUT_CHECK = _float_in(0, None, "> 0", open_lo=True)   # a line's timeout_s


def _stop(name, v, _):
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise Bad(f"{name} must be a string or a list of strings, got {describe(v)}")
    if len(items) > 16:
        raise Bad(f"{name} has {len(items)} strings; at most 16 are allowed")
    for i, s in enumerate(items):
        if not s:
            raise Bad(f"{name} strings must be non-empty (item {i} is empty)")
        encodable(f"{name}[{i}]", s)
    return list(items)


_NON_EMPTY = Annotated[str, Meta(min_length=1)]
_stop.type = _NON_EMPTY | Annotated[list[_NON_EMPTY], Meta(max_length=16)]   # strings still to be checked encodable


def _logit_bias(name, v, _):
    """OpenAI's form: token ids as strings -> a bias in [-100, 100]; at most 300 of them."""
    if not isinstance(v, dict):
        raise Bad(f"{name} must be an object mapping token ids to biases, got {describe(v)}")
    if len(v) > 300:
        raise Bad(f"{name} has {len(v)} entries; at most 300 are allowed")
    out = {}
    for token, bias in v.items():
        if not (isinstance(token, str) and token.isascii() and token.isdigit() and len(token) <= 9):
            raise Bad(f"{name} keys must be token ids (digits), got {token!r}")
        out[str(int(token))] = _float_in(-100, 100, "between -100 and 100")(
            f"{name}[{token!r}]", bias, None)
    return out


def _bool(name, v, _):
    if not isinstance(v, bool):
        raise Bad(f"{name} must be true or false, got {describe(v)}")
    return v


_bool.type = bool


def string(name, v, max_chars):
    if not isinstance(v, str) or not v:
        raise Bad(f"{name} must be a non-empty string, got {describe(v)}")
    if len(v) > max_chars:
        raise Bad(f"{name} has {len(v)} characters; the limit is {max_chars}")
    encodable(name, v)
    return v


def encodable(name: str, s: str) -> None:
    """Reject lone surrogates (legal as JSON \\ud800 escapes, but not text a tokenizer can take)."""
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise Bad(f"{name} contains an unpaired surrogate {s[e.start]!a}") from None


def storable(name: str, s: str) -> None:
    """Reject text the ledger cannot store: a NUL (PostgreSQL's text cannot hold one; SQLite's
    can, and both must take the same input) or a lone surrogate (UTF-8 cannot carry one). For
    what reaches SQL (request ids, file names, metadata); prompts go to Parquet and may hold NUL."""
    if "\x00" in s:
        raise Bad(f"{name} contains a NUL character (\\u0000), which the job ledger cannot store")
    encodable(name, s)


def describe(v) -> str:
    """A short, human description of a JSON value for error messages."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return repr(v) if len(v) <= 40 else f"a string of {len(v)} characters"
    if isinstance(v, list):
        return "a list" if v else "an empty list"
    return "an object"


# The sampling settings an input line may give, each with the range a job accepts.
SAMPLING_CHECKS = {
    "max_tokens": int_in(1, 1_000_000),
    "temperature": _float_in(0, 2, "between 0 and 2"),
    "top_p": _float_in(0, 1, "in (0, 1]", open_lo=True),
    "top_k": int_in(0, None),
    "min_p": _float_in(0, 1, "in [0, 1]"),
    "repetition_penalty": _float_in(0, 10, "in (0, 10]", open_lo=True),
    "frequency_penalty": _float_in(-2, 2, "between -2 and 2"),
    "presence_penalty": _float_in(-2, 2, "between -2 and 2"),
    "logit_bias": _logit_bias,
    "seed": int_in(-2**63, 2**63 - 1),
    "stop": _stop,
    "ignore_eos": _bool,
    "n": int_in(1, MAX_CHOICES),
}

# Their defaults are the engine's (an absent or null setting gets it).
SAMPLING_DEFAULTS = {f.name: f.default_factory() if f.default is MISSING else f.default
                     for f in fields(SamplingParams) if f.name in SAMPLING_CHECKS}
_SAMPLING_ORDER = {key: i for i, key in enumerate(SAMPLING_DEFAULTS)}
# Body fields of an OpenAI batch line we honour; top_k and the rest are extensions.
_OPENAI_BODY_KEYS = {"model", "max_completion_tokens", *SAMPLING_DEFAULTS, *STRUCTURED_KEYS}
