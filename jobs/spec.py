"""Job input files: streaming validation and normalisation into RequestSpec.

An input file is JSONL, one request a line, either in the pipeline's own format or in
the OpenAI Batch API format; the first request line decides which. Validation is one
streaming pass that keeps only the ids seen so far, and it reports every bad line with
its 1-based line number. Valid requests become `RequestSpec`s, whose `to_dict()` is the
shard-file line of docs/contracts.md (jobs.request_spec; jobs.shards writes them). The
checks of single fields are in jobs.request_fields (and answer_fields, embedding_fields);
reading the file itself in jobs.input_file.

A job runs one model: an OpenAI line whose body names another model than the job's is
refused (the job's model as given, or its directory's name, e.g. "Qwen2.5-0.5B-Instruct"
for /models/Qwen2.5-0.5B-Instruct, both match; with served names, `--served-model-name
gpt-4o-mini`, exactly those). Pass those names as `model`, a tuple, instead of the model.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from jobs.answer_fields import echo_setting, forced_tool, logprobs_setting, structured_output
from jobs.embedding_fields import (
    OPENAI_EMBEDDING_KEYS, PIPELINE_EMBEDDING_KEYS, dimensions_setting, embedding_inputs, encoding_format_setting,
)
from jobs.atomic import describe_file_type
from jobs.input_file import open_regular_file, read_lines
from jobs.request_fields import (
    DECODER, EMBEDDINGS_ENDPOINT, ENDPOINTS, SAMPLING_DEFAULTS, STRUCTURED_KEYS, TOOL_KEYS, Bad, check, describe, openai_body,
    request_inputs, request_timeout, sampling_settings, string, too_deep,
)
from jobs.request_spec import RequestSpec   # re-exported: the type every reader of shard lines uses

__all__ = ["InvalidInput", "LineError", "Limits", "RequestSpec", "Scan", "Validation", "iter_lines",
           "open_regular_file", "validate"]

_BOM = b"\xef\xbb\xbf"
_PIPELINE_KEYS = {"id", "prompt", "messages", "timeout_s", "logprobs", *SAMPLING_DEFAULTS, *STRUCTURED_KEYS,
                  *TOOL_KEYS}
_OPENAI_KEYS = {"custom_id", "method", "url", "body"}


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

    def report(self, heading: str, shown: int | None = None) -> str:
        """The errors as the CLI prints them and the HTTP API returns them: the heading
        line, then one line each (the first `shown`; all that were kept by default)."""
        errors = self.errors if shown is None else self.errors[:shown]
        lines = [heading, *map(str, errors)]
        if self.num_errors > len(errors):
            lines.append(f"... and {self.num_errors - len(errors)} more")
        return "\n".join(lines)

    def describe(self, name: str, what: str) -> str:
        """Every kept error under `<name>: N error(s), <what>:` (what: what was not done)."""
        return self.report(f"{name}: {self.num_errors} error(s), {what}:")


class InvalidInput(Exception):
    """The input file has errors; `.validation` has them all (up to Limits.max_errors_kept)."""

    def __init__(self, validation: Validation, shown: int = 20):
        self.validation = validation
        super().__init__(validation.report(f"{validation.num_errors} error(s) in the input file:", shown))


def iter_lines(path, limits: Limits = Limits(), *, model: str | tuple[str, ...] | None = None,
               ) -> Iterator[tuple[int, RequestSpec | LineError]]:
    """Stream (line number, RequestSpec or LineError) over the request lines of `path`.

    Blank lines are skipped. File-level errors (too big, no requests) come with line number 0.
    """
    return iter(_Reader(path, limits, model))


class Scan:
    """One streaming pass that validates a whole file and hands on its requests.

    Iterating yields each valid request in input order while the file has had no error
    (after the first bad line nothing more is yielded, but every line is still checked);
    once iteration ends, `validation` holds the outcome. A job's shards are written from
    the same pass that validates the file (jobs.shards.write_input_shards).
    """

    def __init__(self, path, limits: Limits = Limits(), *, model: str | tuple[str, ...] | None = None):
        self.limits = limits
        self._reader = _Reader(path, limits, model)
        self.validation: Validation | None = None

    def __iter__(self) -> Iterator[RequestSpec]:
        num_requests, errors, num_errors = 0, [], 0
        for _, item in self._reader:
            if isinstance(item, RequestSpec):
                num_requests += 1
                if not num_errors:
                    yield item
                continue
            num_errors += 1
            if len(errors) < self.limits.max_errors_kept:
                errors.append(item)
        self.validation = Validation(num_requests, errors, num_errors, self._reader.input_format or "pipeline",
                                     self._reader.endpoint)


def validate(path, limits: Limits = Limits(), *, model: str | tuple[str, ...] | None = None) -> Validation:
    """Validate the whole file in one streaming pass; with `model`, the job's model, lines naming another are refused."""
    scan = Scan(path, limits, model=model)
    for _ in scan:
        pass
    return scan.validation


class _Reader:
    """One streaming pass over an input file; learns the file's format as it goes."""

    def __init__(self, path, limits: Limits, job_model: str | tuple[str, ...] | None = None):
        # job_model: the job's model (a line may name it as given or by its directory's name),
        # or the exact names it is served as (--served-model-name).
        self.path, self.limits = path, limits
        self.model_names = (None if job_model is None else _names_of(job_model) if isinstance(job_model, str)
                            else tuple(job_model))
        self.job_model = job_model if isinstance(job_model, str) else None
        self.input_format: str | None = None     # set by the first JSON-object line
        self.format_line: int | None = None
        self.endpoint: str | None = None         # set by the first OpenAI line with a known url
        self.endpoint_line: int | None = None
        self._seen: dict[str, int] = {}          # id -> line it was first used on

    def __iter__(self) -> Iterator[tuple[int, RequestSpec | LineError]]:
        lim = self.limits
        f, st = open_regular_file(self.path)
        if f is None:
            yield 0, LineError(None, f"the input is {describe_file_type(st)}, not a regular file; give a file "
                                     "(or - to read standard input once)")
            return
        if st.st_size > lim.max_file_bytes:
            f.close()
            yield 0, LineError(None, f"the input file is {st.st_size} bytes; the limit is {lim.max_file_bytes} bytes")
            return
        request_lines = 0
        for number, raw in read_lines(f, lim.max_line_bytes):
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
            except Bad as e:
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
            raise Bad(f"{what} in a file whose first request (line {self.format_line}) is {first}; "
                       "a file must use one format throughout")
        problems: list[str] = []
        if fmt == "openai":
            rid, model, req, labels = self._openai(number, obj, problems)
        else:
            rid, model, req, labels = self._pipeline(number, obj, problems)
        if labels is _EMBEDDING:
            return self._embedding(number, rid, model, req, problems)
        inputs = request_inputs(req, self.limits.max_prompt_chars, problems)
        sampling = sampling_settings(req, labels, problems)
        timeout_s = request_timeout(req, problems)
        structured = structured_output(req, problems)
        logprobs = logprobs_setting(req, self.endpoint if fmt == "openai" else None, problems)
        echo = echo_setting(req, self.endpoint if fmt == "openai" else None, problems)
        tools, tool_call, tool_spec = forced_tool(req, problems)
        if tool_spec is not None:
            if structured is not None:
                problems.append("a forced tool call already fixes the answer's form: give tools or "
                                "response_format / structured_outputs, not both")
            structured = tool_spec
        if tools is not None and inputs["messages"] is None:
            problems.append("tools need messages (a chat request)")
        self._check_model(model, problems)
        if rid is not None:
            self._claim(number, rid, problems)
        if problems:
            raise Bad("; ".join(problems))
        return RequestSpec(id=rid, line=number, **inputs, **sampling, model=model, timeout_s=timeout_s,
                           structured_output=structured, tools=tools, tool_call=tool_call, logprobs=logprobs,
                           echo=echo)

    def _embedding(self, number: int, rid: str | None, model: str | None, req: dict, problems: list[str]):
        """An embedding request's spec: its inputs, dimensions and output encoding."""
        inputs = embedding_inputs(req.get("input"), self.limits.max_prompt_chars, problems) if "input" in req else None
        if inputs is None and not any(p.startswith("input") for p in problems):
            problems.append("missing input")
        dimensions = dimensions_setting(req.get("dimensions"), problems)
        encoding = encoding_format_setting(req.get("encoding_format"), problems)
        timeout_s = request_timeout(req, problems)
        self._check_model(model, problems)
        if rid is not None:
            self._claim(number, rid, problems)
        if problems:
            raise Bad("; ".join(problems))
        return RequestSpec(id=rid, line=number, prompt=None, messages=None, **_EMBEDDING_SAMPLING, stop=[], model=model,
                           timeout_s=timeout_s, n=len(inputs), input=inputs, dimensions=dimensions,
                           encoding_format=encoding)

    def _check_model(self, model: str | None, problems: list[str]) -> None:
        if model is not None and self.model_names is not None and model not in self.model_names:
            if self.job_model is not None:
                problems.append(f"model {model!r} is not the job's model {self.job_model!r}; a job runs one model "
                                "(choose it with --model, name it with --served-model-name, or leave body.model out)")
            else:
                problems.append(f"model {model!r} is not a name of the job's model (served as "
                                f"{', '.join(map(repr, self.model_names))}; --served-model-name adds names)")

    def _parse(self, number: int, raw: bytes) -> dict:
        if number == 1 and raw.startswith(_BOM):
            raw = raw[len(_BOM):]
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise Bad(f"the line is not valid UTF-8 (bad byte at offset {e.start})") from None
        try:
            obj = DECODER.decode(text)
        except RecursionError:
            raise Bad(f"the JSON is nested too deeply (the limit is {self.limits.max_depth} levels)") from None
        except json.JSONDecodeError as e:
            if "\r" in text:
                raise Bad("invalid JSON: the line holds a carriage return (\\r) not followed by a newline; the "
                          "file's lines seem to end with CR alone (old Mac style): end them with \\n or \\r\\n") from None
            raise Bad(f"invalid JSON: {e.msg} at column {e.colno}") from None
        except ValueError as e:  # NaN/Infinity, or an integer with too many digits
            raise Bad(f"invalid JSON: {e}") from None
        # Bracket count bounds the depth: the full walk is only needed for bracket-heavy lines.
        brackets = raw.count(b"[") + raw.count(b"{")
        if brackets > self.limits.max_depth and too_deep(obj, self.limits.max_depth):
            raise Bad(f"the JSON is nested too deeply (the limit is {self.limits.max_depth} levels)")
        if not isinstance(obj, dict):
            raise Bad(f"expected a JSON object (one request), got {describe(obj)}")
        return obj

    def _pipeline(self, number: int, obj: dict, problems: list[str]):
        embedding = "input" in obj
        self._same_kind(number, EMBEDDINGS_ENDPOINT if embedding else None, problems)
        allowed = PIPELINE_EMBEDDING_KEYS if embedding else _PIPELINE_KEYS
        problems += [f"unknown field {k!r} (allowed{' in an embedding line' if embedding else ''}: "
                     f"{', '.join(sorted(allowed))})" for k in sorted(obj.keys() - allowed)]
        rid = f"line-{number:06d}"  # a stable id for lines without one
        if obj.get("id") is not None:
            rid = check(string, "id", obj["id"], self.limits.max_id_chars, problems)
        if embedding:
            return rid, None, obj, _EMBEDDING
        if obj.get("prompt") is not None and obj.get("messages") is not None:
            problems.append("give either prompt or messages, not both")
        elif obj.get("prompt") is None and obj.get("messages") is None:
            problems.append("missing prompt or messages (give exactly one)")
        return rid, None, obj, {}

    def _same_kind(self, number: int, endpoint: str | None, problems: list[str]) -> None:
        """A pipeline-format file is all generation or all embeddings (`input` lines): the first line decides."""
        if self.endpoint_line is None:
            self.endpoint, self.endpoint_line = endpoint, number
        elif endpoint != self.endpoint:
            kinds = {None: "a generation line (prompt or messages)", EMBEDDINGS_ENDPOINT: "an embedding line (input)"}
            problems.append(f"{kinds[endpoint]} in a file whose first request (line {self.endpoint_line}) is "
                            f"{kinds[self.endpoint]}; a file must be one or the other throughout")

    def _openai(self, number: int, obj: dict, problems: list[str]):
        problems += [f"unknown field {k!r} (an OpenAI batch line has custom_id, method, url and body)"
                     for k in sorted(obj.keys() - _OPENAI_KEYS)]
        rid = None
        if obj.get("custom_id") is None:
            problems.append("missing custom_id")
        else:
            rid = check(string, "custom_id", obj["custom_id"], self.limits.max_id_chars, problems)
        if obj.get("method") != "POST":
            problems.append(f"method must be \"POST\", got {describe(obj.get('method'))}")
        url = obj.get("url")
        if url not in ENDPOINTS:
            problems.append(f"unknown url {describe(url)} (allowed: {', '.join(ENDPOINTS)})")
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
            problems.append(f"body must be an object, got {describe(body)}")
            return rid, None, {}, {}
        # The body is read as the file's endpoint asks (a line naming another url is already an error).
        endpoint = self.endpoint if self.endpoint is not None else url if url in ENDPOINTS else None
        if endpoint is None:  # the url error above already says what is wrong
            return rid, None, {}, {}
        if endpoint == EMBEDDINGS_ENDPOINT:
            problems += [f"unsupported field {k!r} in a {endpoint} body" for k in sorted(body.keys() - OPENAI_EMBEDDING_KEYS)]
            model = body.get("model")
            if model is not None:
                model = check(string, "model", model, self.limits.max_id_chars, problems)
            return rid, model, body, _EMBEDDING
        return (rid, *openai_body(endpoint, body, self.limits.max_id_chars, problems))

    def _claim(self, number: int, rid: str, problems: list[str]) -> None:
        first = self._seen.setdefault(rid, number)
        if first != number:
            problems.append(f"duplicate id {rid!r} (first on line {first})")


_EMBEDDING = object()   # the labels of an embedding line: _request sends it to _embedding
# An embedding request samples nothing: its shard line keeps the defaults of RequestSpec's
# required sampling fields (stop is given afresh per request), so it reads like any other.
_EMBEDDING_SAMPLING = {k: SAMPLING_DEFAULTS[k] for k in ("max_tokens", "temperature", "top_p", "top_k", "min_p",
                                                         "repetition_penalty", "seed", "ignore_eos")}


def _names_of(job_model: str) -> tuple[str, str]:
    """The names a line may use for the job's model: as given, or its directory's name."""
    return job_model, Path(job_model).name
