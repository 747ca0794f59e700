"""Job input files: streaming validation and normalisation into request lines.

An input file is JSONL, one request a line, either in the pipeline's own format or in
the OpenAI Batch API format; the first request line decides which (a Parquet table's rows
are read as the lines they stand for, numbered as rows: jobs.input.request_source). Validation is one
streaming pass (of the whole file, or of each of its line ranges: jobs.input.file_scan) that
keeps a digest of each id seen (jobs.input.unique_ids), and it reports every bad line with its
1-based line number; the file's outcome is a jobs.input.validation.Validation. Each valid request
becomes its shard-file line of docs/contracts.md, a dict (jobs.input.request_spec.request_line;
RequestSpec.from_dict makes the request of it; jobs.input.shard_files writes them). The
checks of single fields are in jobs.input.field_checks (and answer_shape_checks, embedding_checks,
prompt_checks); reading the file itself in jobs.input.file_reading, a line's JSON in jobs.input.strict_json.

A job runs one model: an OpenAI line whose body names another model than the job's is
refused (the job's model as given, or its directory's name, e.g. "Qwen2.5-0.5B-Instruct"
for /models/Qwen2.5-0.5B-Instruct, both match; with served names, `--served-model-name
gpt-4o-mini`, exactly those). Pass those names as `model`, a tuple, instead of the model.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

from jobs.input.answer_shape_checks import CHAT_FORCED_CALL, echo_setting, forced_tool, logprobs_setting, structured_output
from jobs.input.embedding_checks import (
    OPENAI_EMBEDDING_KEYS, PIPELINE_EMBEDDING_KEYS, dimensions_setting, embedding_inputs, encoding_format_setting,
)
from jobs.input.prompt_checks import reasoning_effort, request_inputs
from jobs.input.file_reading import open_regular_file
from jobs.input.field_checks import (
    CHAT_ENDPOINT, COMPLETIONS_ENDPOINT, EMBEDDINGS_ENDPOINT, ENDPOINTS, RESPONSES_ENDPOINT, SAMPLING_DEFAULTS,
    STRUCTURED_KEYS, TEMPLATE_KEYS, TOOL_KEYS, Bad, check, describe, openai_body, request_timeout, sampling_settings,
    storable, string,
)
from jobs.input.plain_lines import PlainLines
from jobs.input.request_spec import OPTIONAL_FIELDS, RequestSpec, request_line   # RequestSpec re-exported: a shard line's type
from jobs.input.responses_body import FORCED_CALL as RESPONSES_FORCED_CALL
from jobs.input.responses_body import responses_body
from jobs.input.request_source import TableColumns, objects_of, open_source
from jobs.input.unique_ids import IdLog
from jobs.input.validation import InvalidInput, LineError, Limits, RangeOutcome, Validation, complete   # re-exported

__all__ = ["InvalidInput", "LineError", "Limits", "RequestSpec", "Scan", "Validation", "iter_lines",
           "open_regular_file", "validate"]

_PIPELINE_KEYS = {"id", "model", "prompt", "messages", "timeout_s", "logprobs", *SAMPLING_DEFAULTS, *STRUCTURED_KEYS,
                  *TOOL_KEYS, *TEMPLATE_KEYS}
_OPENAI_KEYS = {"custom_id", "method", "url", "body"}
# a table's columns that are our format's fields (not `model`: a table's model column stays what it was, data)
_TABLE_FIELDS = (_PIPELINE_KEYS - {"model"}) | PIPELINE_EMBEDDING_KEYS
_PLAIN_ENDPOINTS = (CHAT_ENDPOINT, COMPLETIONS_ENDPOINT)
_FIELDS_OF = {RESPONSES_ENDPOINT: CHAT_ENDPOINT}   # a responses body is checked as the chat body it amounts to
_FORCED_CALL = {RESPONSES_ENDPOINT: RESPONSES_FORCED_CALL}   # how a line's API writes a forced tool_choice
# The fields whose checks give the answer's form (jobs.input.answer_shape_checks); a line without any has none.
_SHAPING_KEYS = frozenset({*STRUCTURED_KEYS, *TOOL_KEYS, "logprobs", "top_logprobs", "echo"})


def iter_lines(path, limits: Limits = Limits(), *, model: str | tuple[str, ...] | None = None,
               columns: TableColumns | None = None) -> Iterator[tuple[int, RequestSpec | LineError]]:
    """Stream (line number, RequestSpec or LineError) over the request lines of `path` (the rows
    of a Parquet table), each checked on its own: the file-wide checks (each id once, at least
    one request) are Scan's and validate's. A file that cannot be read yields one error with line number 0."""
    items, problem = _Reader(limits, model).open(path, columns)
    if problem is not None:
        yield 0, problem
        return
    for number, item in items:
        yield number, item if isinstance(item, LineError) else RequestSpec.from_dict(item)


class Scan:
    """One streaming pass that validates a file (or a range of its lines) and hands on its requests.

    Iterating yields each valid request's line (a dict: jobs.input.request_spec.request_line) in
    input order while the scan has met no error
    (after the first bad line nothing more is yielded, but every line is still checked);
    once iteration ends, `outcome` holds what the pass found and, for a whole file,
    `validation` the file's outcome (jobs.input.validation.complete, with the file-wide id check:
    a request yielded may turn out to be a duplicate, and the file then invalid).

    span (start byte, end byte, the number of its first line) and seed (the outcome of the
    file's start, whose format and endpoint it goes on with) make it a scan of one range
    (jobs.input.file_scan); `validation` is then left to whoever joins the ranges.
    columns: the columns of a Parquet table that make its lines (jobs.input.parquet_lines).
    """

    def __init__(self, path, limits: Limits = Limits(), *, model: str | tuple[str, ...] | None = None,
                 span: tuple[int, int, int] | None = None, seed: RangeOutcome | None = None,
                 columns: TableColumns | None = None):
        self.path, self.limits, self.span, self.columns = path, limits, span, columns
        self._reader = _Reader(limits, model, seed)
        self.outcome: RangeOutcome | None = None
        self.validation: Validation | None = None

    def __iter__(self) -> Iterator[dict]:
        limits, reader = self.limits, self._reader
        outcome = RangeOutcome(ids=reader.ids)
        items, problem = reader.open(self.path, self.columns, self.span)
        if problem is not None:
            outcome.add_error(problem, limits)
            outcome.request_lines = 1   # refused as a file, not also for having no requests
        else:
            for _, item in items:
                if not isinstance(item, LineError):
                    outcome.num_requests += 1
                    if not outcome.num_errors:
                        yield item
                else:
                    outcome.add_error(item, limits)
            outcome.request_lines = reader.request_lines
        outcome.input_format, outcome.format_line = reader.input_format, reader.format_line
        outcome.endpoint, outcome.endpoint_line = reader.endpoint, reader.endpoint_line
        outcome.unit = reader.unit
        self.outcome = outcome
        if self.span is None:
            self.validation = complete([outcome], limits,
                                       lambda lines: claimed_ids(self.path, lines, outcome, limits, self.columns))


def claimed_ids(path, lines, start: RangeOutcome, limits: Limits, columns: TableColumns | None = None,
                ) -> dict[int, str]:
    """The id each of `lines` claimed, read again (the lines whose id digests met:
    jobs.input.unique_ids); start: the outcome of the file's start (its format)."""
    reader = _Reader(limits, None, start)
    return {number: reader.claimed_id(number, obj)
            for number, obj in objects_of(path, limits, columns, _TABLE_FIELDS, set(lines))}


def validate(path, limits: Limits = Limits(), *, model: str | tuple[str, ...] | None = None) -> Validation:
    """Validate the whole file in one streaming pass; with `model`, the job's model, lines naming
    another are refused. (jobs.input.file_scan.validate does the same in parallel for a large file.)"""
    scan = Scan(path, limits, model=model)
    for _ in scan:
        pass
    return scan.validation


class _Reader:
    """The checks of each request line, in file order; learns the file's format as it goes."""

    def __init__(self, limits: Limits, job_model: str | tuple[str, ...] | None = None,
                 seed: RangeOutcome | None = None, plain: bool = True):
        # job_model: the job's model (a line may name it as given or by its directory's name),
        # or the exact names it is served as (--served-model-name).
        self.limits = limits
        self.model_names = (None if job_model is None else _names_of(job_model) if isinstance(job_model, str)
                            else tuple(job_model))
        self.job_model = job_model if isinstance(job_model, str) else None
        self.several = isinstance(job_model, SeveralModels)   # each line must name one of them
        self.input_format: str | None = None     # set by the first JSON-object line
        self.format_line: int | None = None
        self.endpoint: str | None = None         # set by the first OpenAI line with a known url
        self.endpoint_line: int | None = None
        if seed is not None:                     # a later range goes on from the file's start
            self.input_format, self.format_line = seed.input_format, seed.format_line
            self.endpoint, self.endpoint_line = seed.endpoint, seed.endpoint_line
        self.unit = seed.unit if seed is not None else "line"   # what its numbers count: "row" of a table
        self.ids = IdLog()                       # every id claimed, with its line (jobs.input.unique_ids)
        # plain lines checked at C speed (jobs.input.plain_lines); False: every line by the full checks
        self._plain = PlainLines(limits.max_id_chars, limits.max_prompt_chars, self.model_names) if plain else None
        self.request_lines = 0

    def open(self, path, columns: TableColumns | None = None, span: tuple[int, int | None, int] | None = None):
        """(the (number, request line or LineError) of each request of the input at path, None),
        or (None, the file-level problem that refuses it): jobs.input.request_source.open_source's."""
        source, problem = open_source(path, self.limits, columns, _TABLE_FIELDS, span)
        if problem is not None:
            return None, problem
        self.unit = source.unit
        return self._checked(source.items), None

    def _checked(self, items) -> Iterator[tuple[int | None, dict | LineError]]:
        lim = self.limits
        for number, obj in items:
            if number is None:   # the file cannot be read on
                yield None, LineError(None, str(obj))
                return
            self.request_lines += 1
            if self.request_lines > lim.max_requests:
                yield number, LineError(number, f"the file has more than {lim.max_requests} requests, the limit; "
                                                "split it into several jobs", self.unit)
                return
            try:
                if isinstance(obj, Bad):   # not even an object (not JSON, a line too long, a row's bad value)
                    raise obj
                yield number, self._request(number, obj)
            except Bad as e:
                yield number, LineError(number, str(e), self.unit)

    def _request(self, number: int, obj: dict) -> dict:
        fmt = "pipeline" if _OPENAI_KEYS.isdisjoint(obj) else "openai"
        if self.input_format is None:
            self.input_format, self.format_line = fmt, number
        elif fmt != self.input_format:
            what = "an OpenAI batch line" if fmt == "openai" else "a pipeline-format line"
            first = "an OpenAI batch line" if self.input_format == "openai" else "in the pipeline format"
            raise Bad(f"{what} in a file whose first request ({self.unit} {self.format_line}) is {first}; "
                       "a file must use one format throughout")
        if self._plain is not None and (line := self._plain_line(number, obj, fmt)) is not None:
            if line["id"] is None:
                line["id"] = _default_id(number, self.unit)
            refused: list[str] = []
            if self.several and line.get("model") is None:
                self._check_model(None, refused)
            self._claim(number, line["id"], refused)
            if refused:
                raise Bad("; ".join(refused))
            return line
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
        effort = reasoning_effort(req, problems)
        structured = logprobs = tools = tool_call = tool_spec = None
        echo = False
        if not _SHAPING_KEYS.isdisjoint(req):   # most lines ask for none of these: their checks are skipped
            structured = structured_output(req, problems, labels)
            endpoint = self.endpoint if fmt == "openai" else None
            fields_of = _FIELDS_OF.get(endpoint, endpoint)   # the endpoint whose fields the line's are
            logprobs = logprobs_setting(req, fields_of, problems)
            echo = echo_setting(req, fields_of, problems)
            tools, tool_call, tool_spec = forced_tool(req, problems, _FORCED_CALL.get(endpoint, CHAT_FORCED_CALL))
        if tool_spec is not None:
            if structured is not None:
                problems.append("a forced tool call already fixes the answer's form: give tools or "
                                "response_format / structured_outputs, not both")
            structured = tool_spec
        if tools is not None and inputs["messages"] is None:
            problems.append("tools need messages (a chat request)")
        if echo and inputs["prompts"] and not isinstance(inputs["prompts"][0], str):
            problems.append("echo needs prompts given as text (it puts their text before the answers), not token ids")
        self._check_vocabulary("prompt", inputs["prompts"], sampling.get("logit_bias"), problems)
        self._check_model(model, problems)
        if rid is not None:
            self._claim(number, rid, problems)
        if problems:
            raise Bad("; ".join(problems))
        return request_line({"id": rid, "line": number, **inputs, **sampling, "model": model, "timeout_s": timeout_s,
                             "structured_output": structured, "tools": tools, "tool_call": tool_call,
                             "logprobs": logprobs, "echo": echo, "reasoning_effort": effort})

    def _plain_line(self, number: int, obj: dict, fmt: str) -> dict | None:
        """The line's request line by jobs.input.plain_lines (None: the full checks decide), once the
        file's start has settled what its lines must be."""
        if fmt == "pipeline":
            return self._plain.pipeline(number, obj) if self.endpoint_line is not None and self.endpoint is None else None
        return self._plain.openai(number, obj, self.endpoint) if self.endpoint in _PLAIN_ENDPOINTS else None

    def _embedding(self, number: int, rid: str | None, model: str | None, req: dict, problems: list[str]):
        """An embedding request's spec: its inputs, dimensions and output encoding."""
        inputs = embedding_inputs(req.get("input"), self.limits.max_prompt_chars, problems) if "input" in req else None
        if inputs is None and not any(p.startswith("input") for p in problems):
            problems.append("missing input")
        dimensions = dimensions_setting(req.get("dimensions"), problems)
        encoding = encoding_format_setting(req.get("encoding_format"), problems)
        self._check_vocabulary("input", inputs, None, problems)
        timeout_s = request_timeout(req, problems)
        self._check_model(model, problems)
        if rid is not None:
            self._claim(number, rid, problems)
        if problems:
            raise Bad("; ".join(problems))
        return request_line({"id": rid, "line": number, "prompt": None, "messages": None, **_EMBEDDING_SAMPLING,
                             "stop": [], "model": model, "timeout_s": timeout_s, "n": len(inputs), "input": inputs,
                             "dimensions": dimensions, "encoding_format": encoding})

    def _check_vocabulary(self, name: str, items: list | None, logit_bias: dict | None, problems: list[str]) -> None:
        """Every token id of the line (prompts or inputs given as ids, logit_bias keys) within the
        model's vocabulary: an id beyond it would fail the engine step, not only this request."""
        vocab = self.limits.vocab_size
        if vocab is None:
            return
        for i, item in enumerate(items or ()):
            if isinstance(item, list) and max(item) >= vocab:
                where = name if len(items) == 1 else f"{name}[{i}]"
                problems.append(f"{where} holds token id {max(item)}; the model's vocabulary has ids 0 to {vocab - 1}")
        beyond = [int(token) for token in logit_bias or () if int(token) >= vocab]
        if beyond:
            problems.append(f"logit_bias names token id {max(beyond)}; the model's vocabulary has ids 0 to {vocab - 1}")

    def _check_model(self, model: str | None, problems: list[str]) -> None:
        if self.several:
            if model not in self.model_names:
                named = "names no model" if model is None else f"names the model {model!r}, not one of the job's"
                problems.append(f"the line {named}; a job of several models needs each line to name one of "
                                f"{', '.join(map(repr, self.model_names))} (body.model, or model in our format)")
            return
        if model is not None and self.model_names is not None and model not in self.model_names:
            if self.job_model is not None:
                problems.append(f"model {model!r} is not the job's model {self.job_model!r}; a job runs one model "
                                "(choose it with --model, name it with --served-model-name, or leave body.model out)")
            else:
                problems.append(f"model {model!r} is not a name of the job's model (served as "
                                f"{', '.join(map(repr, self.model_names))}; --served-model-name adds names)")

    def _pipeline(self, number: int, obj: dict, problems: list[str]):
        embedding = "input" in obj
        self._same_kind(number, EMBEDDINGS_ENDPOINT if embedding else None, problems)
        allowed = PIPELINE_EMBEDDING_KEYS | {"model"} if embedding else _PIPELINE_KEYS
        if not obj.keys() <= allowed:
            problems += [f"unknown field {k!r} (allowed{' in an embedding line' if embedding else ''}: "
                         f"{', '.join(sorted(allowed))})" for k in sorted(obj.keys() - allowed)]
        rid = obj.get("id")
        rid = (_default_id(number, self.unit) if rid is None
               else check(string, "id", rid, self.limits.max_id_chars, problems))
        model = obj.get("model")   # which of the job's models answers it (docs/input-format.md)
        if model is not None:
            model = check(string, "model", model, self.limits.max_id_chars, problems)
        if embedding:
            return rid, model, obj, _EMBEDDING
        if obj.get("prompt") is not None and obj.get("messages") is not None:
            problems.append("give either prompt or messages, not both")
        elif obj.get("prompt") is None and obj.get("messages") is None:
            problems.append("missing prompt or messages (give exactly one)")
        return rid, model, obj, {}

    def _same_kind(self, number: int, endpoint: str | None, problems: list[str]) -> None:
        """A pipeline-format file is all generation or all embeddings (`input` lines): the first line decides."""
        if self.endpoint_line is None:
            self.endpoint, self.endpoint_line = endpoint, number
        elif endpoint != self.endpoint:
            kinds = {None: "a generation line (prompt or messages)", EMBEDDINGS_ENDPOINT: "an embedding line (input)"}
            problems.append(f"{kinds[endpoint]} in a file whose first request ({self.unit} {self.endpoint_line}) is "
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
            problems.append(f"url {url!r} differs from {self.endpoint!r} of {self.unit} {self.endpoint_line}; "
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
        if endpoint == RESPONSES_ENDPOINT:
            return (rid, *responses_body(body, self.limits.max_id_chars, self.limits.max_prompt_chars, problems))
        return (rid, *openai_body(endpoint, body, self.limits.max_id_chars, problems))

    def _claim(self, number: int, rid: str, problems: list[str]) -> None:
        """Claim the line's id, unless the ledger could not store it (a NUL, a lone surrogate:
        the stored answers' index keeps it). Whether another line has it is known once the
        whole file is read (jobs.input.validation.complete)."""
        try:
            storable("custom_id" if self.input_format == "openai" else "id", rid)
        except Bad as e:
            problems.append(str(e))
            return
        self.ids.add(rid, number)

    def claimed_id(self, number: int, obj: dict) -> str:
        """The id line `number` (parsed: obj) claimed, as _pipeline and _openai take it (a line claims one
        only once its id is valid)."""
        if self.input_format == "openai":
            return obj["custom_id"]
        return obj["id"] if obj.get("id") is not None else _default_id(number, self.unit)


_EMBEDDING = object()   # the labels of an embedding line: _request sends it to _embedding
# An embedding request samples nothing: its shard line keeps the defaults of the sampling
# settings every line carries (stop is given afresh per request), so it reads like any other.
_EMBEDDING_SAMPLING = {name: default for name, default in SAMPLING_DEFAULTS.items()
                       if name not in OPTIONAL_FIELDS and name != "stop"}


def _default_id(number: int, unit: str = "line") -> str:
    return f"{unit}-{number:06d}"  # a stable id for a line (or a table's row) without one


class SeveralModels(tuple):
    """The names a line of a job of several models may use (jobs.several_models: each model's served
    names, else as given or by its directory's name): unlike one model's names, every line must
    name one of them."""


def _names_of(job_model: str) -> tuple[str, str]:
    """The names a line may use for the job's model: as given, or its directory's name."""
    return job_model, Path(job_model).name
