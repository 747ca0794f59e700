"""Job input files: streaming validation, normalisation into RequestSpec, and sharding.

An input file is JSONL, one request a line, either in the pipeline's own format or in
the OpenAI Batch API format; the first request line decides which. Validation is one
streaming pass that keeps only the ids seen so far, and it reports every bad line with
its 1-based line number. Valid requests become `RequestSpec`s, whose `to_dict()` is the
shard-file line of docs/contracts.md.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import dataclass, fields
from typing import Iterator

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
_BOM = b"\xef\xbb\xbf"
_SKIP_CHUNK = 1 << 20
_SAMPLING_DEFAULTS = {
    "max_tokens": 256, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
    "repetition_penalty": 1.0, "seed": None, "stop": [], "ignore_eos": False,
}
_PIPELINE_KEYS = {"id", "prompt", "messages", *_SAMPLING_DEFAULTS}
_OPENAI_KEYS = {"custom_id", "method", "url", "body"}
# Body fields of an OpenAI batch line we honour; top_k and the rest are extensions.
_OPENAI_BODY_KEYS = {"model", "n", "max_completion_tokens", *_SAMPLING_DEFAULTS}
_OPENAI_INPUT_KEY = {"/v1/chat/completions": "messages", "/v1/completions": "prompt"}


@dataclass(slots=True)
class Limits:
    """Bounds on an input file; a file breaking one is rejected with a clear error."""
    max_file_bytes: int = 2 * 1024**3
    max_line_bytes: int = 4 * 1024**2
    max_requests: int = 5_000_000
    max_prompt_chars: int = 1_000_000
    max_depth: int = 32
    max_id_chars: int = 512
    max_errors_kept: int = 1000


@dataclass(slots=True)
class LineError:
    """What is wrong with one input line (line is None for file-level problems)."""
    line: int | None
    message: str

    def __str__(self) -> str:
        return self.message if self.line is None else f"line {self.line}: {self.message}"


@dataclass(slots=True)
class RequestSpec:
    """One validated, normalised request (defaults filled in)."""
    id: str
    line: int
    prompt: str | None
    messages: list[dict] | None
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    seed: int | None
    stop: list[str]
    ignore_eos: bool
    model: str | None = None

    def to_dict(self) -> dict:
        """The shard-file line of docs/contracts.md; `model` only when the input named one."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        if d["model"] is None:
            del d["model"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "RequestSpec":
        return cls(**d)


@dataclass
class Validation:
    """The outcome of validating a whole file. `errors` holds the first few; `num_errors` counts all."""
    num_requests: int
    errors: list[LineError]
    num_errors: int
    input_format: str               # "pipeline" | "openai"
    endpoint: str | None            # the OpenAI url shared by every line; None for the pipeline format

    @property
    def ok(self) -> bool:
        return self.num_errors == 0


class InvalidInput(Exception):
    """The input file has errors; `.validation` has them all (up to Limits.max_errors_kept)."""

    def __init__(self, validation: Validation, shown: int = 20):
        self.validation = validation
        lines = [f"{validation.num_errors} error(s) in the input file:"]
        lines += [str(e) for e in validation.errors[:shown]]
        if validation.num_errors > shown:
            lines.append(f"... and {validation.num_errors - shown} more")
        super().__init__("\n".join(lines))


def shard_file_name(index: int) -> str:
    return f"shard-{index:05d}.jsonl"


def iter_lines(path, limits: Limits = Limits()) -> Iterator[tuple[int, RequestSpec | LineError]]:
    """Stream (line number, RequestSpec or LineError) over the request lines of `path`.

    Blank lines are skipped. File-level errors (too big, no requests) come with line number 0.
    """
    return iter(_Reader(path, limits))


def validate(path, limits: Limits = Limits()) -> Validation:
    """Validate the whole file in one streaming pass."""
    reader = _Reader(path, limits)
    num_requests, errors, num_errors = 0, [], 0
    for _, item in reader:
        if isinstance(item, RequestSpec):
            num_requests += 1
            continue
        num_errors += 1
        if len(errors) < limits.max_errors_kept:
            errors.append(item)
    return Validation(num_requests, errors, num_errors, reader.input_format or "pipeline", reader.endpoint)


def write_shards(path, shard_dir, shard_size: int, limits: Limits = Limits()) -> list[int]:
    """Validate `path`, then write its requests to shard_dir/shard-NNNNN.jsonl, `shard_size` a shard.

    Raises InvalidInput (writing nothing) if the file has any error. Each shard is written
    under a temporary name and renamed into place, so a shard file is always complete.
    Returns the number of requests in each shard.
    """
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    validation = validate(path, limits)
    if not validation.ok:
        raise InvalidInput(validation)
    os.makedirs(shard_dir, exist_ok=True)
    counts: list[int] = []
    out, tmp = None, None
    try:
        for _, item in iter_lines(path, limits):
            if isinstance(item, LineError):  # the file changed after validation
                raise InvalidInput(Validation(0, [item], 1, validation.input_format, validation.endpoint))
            if out is None:
                tmp = os.path.join(shard_dir, f".{shard_file_name(len(counts))}.tmp")
                out = open(tmp, "w", encoding="utf-8")
                counts.append(0)
            out.write(json.dumps(item.to_dict(), ensure_ascii=False) + "\n")
            counts[-1] += 1
            if counts[-1] == shard_size:
                _commit(out, tmp, os.path.join(shard_dir, shard_file_name(len(counts) - 1)))
                out = None
        if out is not None:
            _commit(out, tmp, os.path.join(shard_dir, shard_file_name(len(counts) - 1)))
            out = None
    finally:
        if out is not None:
            out.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    return counts


def read_shard(path) -> list[RequestSpec]:
    """The requests of one shard file written by write_shards."""
    with open(path, encoding="utf-8") as f:
        return [RequestSpec.from_dict(json.loads(line)) for line in f if line.strip()]


def _commit(out, tmp: str, final: str) -> None:
    out.flush()
    os.fsync(out.fileno())
    out.close()
    os.replace(tmp, final)


def _read_lines(path, max_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """Yield (line number, line without its newline), or None for a line over max_bytes.

    readline is bounded, so an over-long line is never held whole: it is skipped in chunks.
    """
    with open(path, "rb") as f:
        number = 0
        while chunk := f.readline(max_bytes + 1):
            number += 1
            if chunk.endswith(b"\n"):
                yield number, chunk[:-1]
            elif len(chunk) <= max_bytes:  # the last line, without a newline
                yield number, chunk
            else:
                while (rest := f.readline(_SKIP_CHUNK)) and not rest.endswith(b"\n"):
                    pass
                yield number, None


class _Bad(Exception):
    """One problem with one line; its message is what the user reads."""


class _Reader:
    """One streaming pass over an input file; learns the file's format as it goes."""

    def __init__(self, path, limits: Limits):
        self.path, self.limits = path, limits
        self.input_format: str | None = None     # set by the first JSON-object line
        self.format_line: int | None = None
        self.endpoint: str | None = None         # set by the first OpenAI line with a known url
        self.endpoint_line: int | None = None
        self._seen: dict[str, int] = {}          # id -> line it was first used on

    def __iter__(self) -> Iterator[tuple[int, RequestSpec | LineError]]:
        lim = self.limits
        size = os.path.getsize(self.path)
        if size > lim.max_file_bytes:
            yield 0, LineError(None, f"the input file is {size} bytes; the limit is {lim.max_file_bytes} bytes")
            return
        request_lines = 0
        for number, raw in _read_lines(self.path, lim.max_line_bytes):
            if raw is not None and not raw.strip():
                continue
            request_lines += 1
            if request_lines > lim.max_requests:
                yield number, LineError(number, f"the file has more than {lim.max_requests} requests, the limit; "
                                                "split it into several jobs")
                return
            if raw is None:
                yield number, LineError(number, f"the line is longer than {lim.max_line_bytes} bytes, the limit")
                continue
            try:
                yield number, self._request(number, raw)
            except _Bad as e:
                yield number, LineError(number, str(e))
        if request_lines == 0:
            yield 0, LineError(None, "the file has no requests (it is empty or has only blank lines)")

    def _request(self, number: int, raw: bytes) -> RequestSpec:
        obj = self._parse(number, raw)
        fmt = "openai" if _OPENAI_KEYS & obj.keys() else "pipeline"
        if self.input_format is None:
            self.input_format, self.format_line = fmt, number
        elif fmt != self.input_format:
            what = "an OpenAI batch line" if fmt == "openai" else "a pipeline-format line"
            first = "an OpenAI batch line" if self.input_format == "openai" else "in the pipeline format"
            raise _Bad(f"{what} in a file whose first request (line {self.format_line}) is {first}; "
                       "a file must use one format throughout")
        problems: list[str] = []
        if fmt == "openai":
            rid, model, req, labels = self._openai(number, obj, problems)
        else:
            rid, model, req, labels = self._pipeline(number, obj, problems)
        inputs = _inputs(req, self.limits.max_prompt_chars, problems)
        sampling = _sampling(req, labels, problems)
        if rid is not None:
            self._claim(number, rid, problems)
        if problems:
            raise _Bad("; ".join(problems))
        return RequestSpec(id=rid, line=number, **inputs, **sampling, model=model)

    def _parse(self, number: int, raw: bytes) -> dict:
        if number == 1 and raw.startswith(_BOM):
            raw = raw[len(_BOM):]
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _Bad(f"the line is not valid UTF-8 (bad byte at offset {e.start})") from None
        try:
            obj = _DECODER.decode(text)
        except RecursionError:
            raise _Bad(f"the JSON is nested too deeply (the limit is {self.limits.max_depth} levels)") from None
        except json.JSONDecodeError as e:
            raise _Bad(f"invalid JSON: {e.msg} at column {e.colno}") from None
        except ValueError as e:  # NaN/Infinity, or an integer with too many digits
            raise _Bad(f"invalid JSON: {e}") from None
        # Bracket count bounds the depth: the full walk is only needed for bracket-heavy lines.
        brackets = raw.count(b"[") + raw.count(b"{")
        if brackets > self.limits.max_depth and _too_deep(obj, self.limits.max_depth):
            raise _Bad(f"the JSON is nested too deeply (the limit is {self.limits.max_depth} levels)")
        if not isinstance(obj, dict):
            raise _Bad(f"expected a JSON object (one request), got {_describe(obj)}")
        return obj

    def _pipeline(self, number: int, obj: dict, problems: list[str]):
        problems += [f"unknown field {k!r} (allowed: {', '.join(sorted(_PIPELINE_KEYS))})"
                     for k in sorted(obj.keys() - _PIPELINE_KEYS)]
        rid = f"line-{number:06d}"  # a stable id for lines without one
        if obj.get("id") is not None:
            rid = _check(_string, "id", obj["id"], self.limits.max_id_chars, problems)
        if obj.get("prompt") is not None and obj.get("messages") is not None:
            problems.append("give either prompt or messages, not both")
        elif obj.get("prompt") is None and obj.get("messages") is None:
            problems.append("missing prompt or messages (give exactly one)")
        return rid, None, obj, {}

    def _openai(self, number: int, obj: dict, problems: list[str]):
        problems += [f"unknown field {k!r} (an OpenAI batch line has custom_id, method, url and body)"
                     for k in sorted(obj.keys() - _OPENAI_KEYS)]
        rid = None
        if obj.get("custom_id") is None:
            problems.append("missing custom_id")
        else:
            rid = _check(_string, "custom_id", obj["custom_id"], self.limits.max_id_chars, problems)
        if obj.get("method") != "POST":
            problems.append(f"method must be \"POST\", got {_describe(obj.get('method'))}")
        url = obj.get("url")
        if url not in ENDPOINTS:
            problems.append(f"unknown url {_describe(url)} (allowed: {', '.join(ENDPOINTS)})")
        elif self.endpoint is None:
            self.endpoint, self.endpoint_line = url, number
        elif url != self.endpoint:
            problems.append(f"url {url!r} differs from {self.endpoint!r} of line {self.endpoint_line}; "
                            "every line of a batch must use the same url")
        body = obj.get("body")
        if body is None:
            problems.append("missing body")
            return rid, None, {}, {}
        if not isinstance(body, dict):
            problems.append(f"body must be an object, got {_describe(body)}")
            return rid, None, {}, {}
        endpoint = url if url in ENDPOINTS else self.endpoint
        if endpoint is None:  # the url error above already says what is wrong
            return rid, None, {}, {}
        return (rid, *_openai_body(endpoint, body, self.limits.max_id_chars, problems))

    def _claim(self, number: int, rid: str, problems: list[str]) -> None:
        first = self._seen.setdefault(rid, number)
        if first != number:
            problems.append(f"duplicate id {rid!r} (first on line {first})")


def _openai_body(endpoint: str, body: dict, max_model_chars: int, problems: list[str]):
    """Map an OpenAI request body onto our fields: (model, request fields, labels naming them in errors)."""
    key = _OPENAI_INPUT_KEY[endpoint]
    for k in sorted(body.keys() - _OPENAI_BODY_KEYS - {key}):
        hint = f" in a {endpoint} body (use {key})" if k in _OPENAI_INPUT_KEY.values() else ""
        problems.append(f"unsupported field {k!r}{hint}")
    if body.get(key) is None:
        problems.append(f"missing body.{key}")
    n = body.get("n")
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int):
            problems.append(f"n must be an integer, got {_describe(n)}")
        elif n > 1:
            problems.append(f"n > 1 is not supported (got n={n}); repeat the request on several lines instead")
        elif n < 1:
            problems.append(f"n must be 1, got {n}")
    model = body.get("model")
    if model is not None:
        model = _check(_string, "model", model, max_model_chars, problems)
    req = {k: body.get(k) for k in (key, *_SAMPLING_DEFAULTS)}
    labels = {}
    if body.get("max_completion_tokens") is not None:
        if body.get("max_tokens") is not None:
            problems.append("give max_tokens or max_completion_tokens, not both")
        req["max_tokens"], labels["max_tokens"] = body["max_completion_tokens"], "max_completion_tokens"
    return model, req, labels


def _inputs(req: dict, max_chars: int, problems: list[str]) -> dict:
    """The prompt or messages of a request (presence is checked by the format-specific code)."""
    out = {"prompt": None, "messages": None}
    prompt, messages = req.get("prompt"), req.get("messages")
    if prompt is not None:
        out["prompt"] = _check(_prompt, "prompt", prompt, max_chars, problems)
    if messages is not None:
        out["messages"] = _check(_messages, "messages", messages, max_chars, problems)
    return out


def _sampling(req: dict, labels: dict, problems: list[str]) -> dict:
    """Checked sampling settings, defaults for absent or null ones; errors use the input's names."""
    out = {}
    for key, default in _SAMPLING_DEFAULTS.items():
        value = req.get(key)
        out[key] = list(default) if isinstance(default, list) else default
        if value is not None:
            out[key] = _check(_CHECKS[key], labels.get(key, key), value, None, problems)
    return out


def _check(fn, name: str, value, arg, problems: list[str]):
    """Run one field check, turning its failure into a problem of the line."""
    try:
        return fn(name, value, arg)
    except _Bad as e:
        problems.append(str(e))


def _int_in(lo: int, hi: int | None):
    def check(name, v, _):
        if isinstance(v, bool) or not isinstance(v, int):
            raise _Bad(f"{name} must be an integer, got {_describe(v)}")
        if v < lo or (hi is not None and v > hi):
            allowed = f">= {lo}" if hi is None else f"between {lo} and {hi}"
            raise _Bad(f"{name} must be {allowed}, got {v}")
        return v
    return check


def _float_in(ok, allowed: str):
    def check(name, v, _):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise _Bad(f"{name} must be a number {allowed}, got {_describe(v)}")
        if not math.isfinite(v) or not ok(v):
            raise _Bad(f"{name} must be a number {allowed}, got {v}")
        return float(v)
    return check


def _stop(name, v, _):
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise _Bad(f"{name} must be a string or a list of strings, got {_describe(v)}")
    if len(items) > 16:
        raise _Bad(f"{name} has {len(items)} strings; at most 16 are allowed")
    for i, s in enumerate(items):
        if not s:
            raise _Bad(f"{name} strings must be non-empty (item {i} is empty)")
        _encodable(f"{name}[{i}]", s)
    return list(items)


def _bool(name, v, _):
    if not isinstance(v, bool):
        raise _Bad(f"{name} must be true or false, got {_describe(v)}")
    return v


_CHECKS = {
    "max_tokens": _int_in(1, 1_000_000),
    "temperature": _float_in(lambda x: 0 <= x <= 2, "between 0 and 2"),
    "top_p": _float_in(lambda x: 0 < x <= 1, "in (0, 1]"),
    "top_k": _int_in(0, None),
    "min_p": _float_in(lambda x: 0 <= x <= 1, "in [0, 1]"),
    "repetition_penalty": _float_in(lambda x: 0 < x <= 10, "in (0, 10]"),
    "seed": _int_in(-2**63, 2**63 - 1),
    "stop": _stop,
    "ignore_eos": _bool,
}


def _string(name, v, max_chars):
    if not isinstance(v, str) or not v:
        raise _Bad(f"{name} must be a non-empty string, got {_describe(v)}")
    if len(v) > max_chars:
        raise _Bad(f"{name} has {len(v)} characters; the limit is {max_chars}")
    _encodable(name, v)
    return v



def _prompt(name, v, max_chars):
    if isinstance(v, list):
        raise _Bad(f"{name} must be a single string; a list of prompts or token ids is not supported "
                   "(put each prompt on its own line)")
    if isinstance(v, str) and not v:
        raise _Bad(f"{name} is empty")
    return _string(name, v, max_chars)


def _messages(name, v, max_chars):
    if not isinstance(v, list) or not v:
        raise _Bad(f"{name} must be a non-empty list of {{\"role\", \"content\"}} objects, got {_describe(v)}")
    out, total = [], 0
    for i, m in enumerate(v):
        where = f"{name}[{i}]"
        if not isinstance(m, dict):
            raise _Bad(f"{where} must be an object with role and content, got {_describe(m)}")
        extra = sorted(m.keys() - {"role", "content"})
        if extra:
            raise _Bad(f"{where} has unsupported field {extra[0]!r} (only role and content are allowed)")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise _Bad(f"{where}.role must be a non-empty string, got {_describe(role)}")
        if not isinstance(content, str):
            parts = " (lists of content parts are not supported)" if isinstance(content, list) else ""
            raise _Bad(f"{where}.content must be a string{parts}, got {_describe(content)}")
        _encodable(f"{where}.role", role)
        _encodable(f"{where}.content", content)
        total += len(content)
        out.append({"role": role, "content": content})
    if total > max_chars:
        raise _Bad(f"{name} have {total} characters of content in all; the limit is {max_chars}")
    return out


def _encodable(name: str, s: str) -> None:
    """Reject lone surrogates (legal as JSON \\ud800 escapes, but not text a tokenizer can take)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _Bad(f"{name} contains an unpaired surrogate {s[e.start]!a}") from None


def _reject_constant(name: str):
    raise ValueError(f"{name} is not allowed (numbers must be finite)")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def _too_deep(value, limit: int) -> bool:
    """Whether containers nest more than `limit` levels; iterative, so deep input cannot recurse."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > limit:
                return True
            stack.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))
    return False


def _describe(v) -> str:
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
