"""The one result row: its columns, every way a row is made, and the columns summed.

A row is a plain dict with exactly RESULT_COLUMNS' fields (what pyarrow writes and
readers get back), one per answer: a request with n choices has n rows (n for each of its
prompts when it has a list: RequestSpec.num_rows), (id, choice) with choice 0 .. rows - 1,
and every such pair is in a job's results exactly once. It is made here only: from the
engine's RequestOutput, for a request that failed before or instead of running (an error, an
expired window, a shard given up), or for one a cancel stopped. A new per-request figure is
a field of RequestOutput (set where the engine's output processor makes it) and a column
here; if it is summed, also a name in SUMMED_COLUMNS (plus its ledger columns and their
migration): the shard commit, the job's counts, the stats and the metrics read that list.
"""
from __future__ import annotations

from pipeline.request import FinishReason, RequestOutput, TokenLogprob

# (column, Arrow type): jobs.results.parquet_files makes the Parquet schema (RESULT_SCHEMA) from it (a
# pyarrow type's name, "token_logprobs": OpenAI's list of token logprob entries, or
# "vector": a list of float32). An embedding request has a row per input: `choice` is the
# input's index, `output` is empty and prompt_tokens counts that input's tokens.
RESULT_COLUMNS = (
    ("id", "string"),
    ("choice", "int32"),           # which of the request's n answers (0 .. n - 1; null: older results)
    ("output", "string"),
    ("prompt_tokens", "int32"),
    ("output_tokens", "int32"),
    ("cached_tokens", "int32"),    # prompt tokens served from the prefix cache (null: older results)
    ("draft_tokens", "int32"),     # speculative decoding: tokens drafted (null: older results)
    ("accepted_tokens", "int32"),  # ... and accepted by verification
    ("finish_reason", "string"),   # a pipeline.request.FinishReason value
    ("error", "string"),
    ("queue_s", "float64"),
    ("ttft_s", "float64"),
    ("latency_s", "float64"),
    ("shard", "int32"),
    ("attempt", "int32"),
    ("valid", "bool_"),            # structured output: the answer is complete under its grammar (null: free text)
    ("tool_call", "string"),       # a forced tool call: the function whose arguments `output` is (else null)
    ("reasoning", "string"),       # a thinking model's think block (pipeline.reasoning; `output`: the answer after it)
    ("reasoning_tokens", "int32"),  # ... its tokens, tags included (null: the model does not think)
    ("model", "string"),           # the model name the line used (OpenAI's body.model; null: none given)
    ("logprobs", "token_logprobs"),  # per output token: token, logprob, bytes, top_logprobs (null: not asked)
    ("embedding", "vector"),       # an embedding request: the vector of input `choice` (null: generation)
    ("encoding_format", "string"),  # an embedding line's OpenAI encoding_format when not floats ("base64")
    ("prompt_index", "int32"),     # completions with a list of prompts: which one this answers (else null)
    # Lineage: where the answer came from, so that a rerun can be audited.
    ("line", "int32"),             # the request's line in the job's input file
    ("request_key", "string"),     # its answer's identity (jobs.reuse.answer_key; null: not deterministic)
    ("engine", "string"),          # the fingerprint of the engine that computed it (model files and options)
    ("worker", "string"),          # the worker ("host:pid") that computed it
    ("reused_from", "string"),     # the job whose answer this is, when reused (null: computed for this job)
)

# Per-request token counts that are also kept summed: per shard and per job in the ledger,
# in the job's stats and in the workers' metrics. Each is a RequestOutput field of the same name.
SUMMED_COLUMNS = ("prompt_tokens", "output_tokens", "cached_tokens", "draft_tokens", "accepted_tokens")
# What a shard commit adds to its shard's and its job's ledger row.
SHARD_TOTALS = ("completed_requests", "failed_requests", *SUMMED_COLUMNS)


def from_output(out: RequestOutput, shard: int, attempt: int, spec=None, *, worker: str | None = None,
                engine: str | None = None) -> dict:
    """The row of a request the engine finished (any finish reason). From its spec (a
    jobs.input.line_checks.RequestSpec): tool_call, the function its answer calls when the request forced
    one (its output is the arguments); model, the name the line gave its model (OpenAI output
    reports it); with echo, the prompt before the answer's text (OpenAI completions' echo) and
    its tokens' logprobs before the answer's; its line and key. worker and engine: who computed it."""
    prompt_index = spec.prompt_index(out.choice) if spec is not None else None
    echo = None
    if spec is not None and spec.echo:
        echo = spec.prompt if prompt_index is None else spec.prompts[prompt_index]
    return {"id": out.id, "choice": out.choice, "output": (echo or "") + out.text, **{name: getattr(out, name) for name in SUMMED_COLUMNS},
            "finish_reason": FinishReason(out.finish_reason).value, "error": out.error,
            "queue_s": out.queue_s, "ttft_s": out.ttft_s, "latency_s": out.latency_s,
            "shard": shard, "attempt": attempt, "valid": out.valid, "tool_call": getattr(spec, "tool_call", None),
            "reasoning": out.reasoning, "reasoning_tokens": out.reasoning_tokens,
            "model": getattr(spec, "model", None), "logprobs": _logprobs_column(out, echo is not None),
            "embedding": out.embedding, "encoding_format": getattr(spec, "encoding_format", None),
            "prompt_index": prompt_index, **_lineage(spec), "engine": engine, "worker": worker, "reused_from": None}


def reused(row: dict, spec, shard: int, attempt: int, source_job: str) -> dict:
    """A stored answer's row (of job source_job) as the answer of `spec` in this shard: the
    answer, its token counts and who computed it are the original's, the rest the new request's."""
    return {**row, "id": spec.id, "shard": shard, "attempt": attempt, "model": spec.model,
            "encoding_format": spec.encoding_format, **_lineage(spec),
            "reused_from": row.get("reused_from") or source_job}


def _lineage(spec) -> dict:
    return {"line": getattr(spec, "line", None), "request_key": getattr(spec, "key", None)}


def _logprobs_column(out: RequestOutput, echo: bool) -> list[dict] | None:
    """The logprobs column: OpenAI's chat entries of the answer's tokens (with echo, the
    prompt's before them; the first prompt token's logprob and top_logprobs null), the one
    place they are made (jobs.results.openai_output reshapes them for each endpoint)."""
    if out.logprobs is None:
        return None
    scored = [*(out.prompt_logprobs or ()), *out.logprobs] if echo else out.logprobs
    return [{**_entry(t), "top_logprobs": None if t.top is None else [_entry(alt) for alt in t.top]} for t in scored]


def _entry(token: TokenLogprob) -> dict:
    return {"token": token.text, "logprob": token.logprob, "bytes": list(token.text.encode("utf-8"))}


def error_row(spec, error: str, shard: int, attempt: int, choice: int = 0) -> dict:
    """The row of a request (one choice of it; spec: a jobs.input.line_checks.RequestSpec) that failed
    without output (finish_reason "error")."""
    return _empty(spec, choice, FinishReason.ERROR, error, 0.0, shard, attempt)


def cancelled_row(spec, waited_s: float, shard: int, attempt: int, choice: int = 0) -> dict:
    """The row of a request (one choice of it) a cancel stopped: it waited waited_s and got nothing."""
    return _empty(spec, choice, FinishReason.CANCELLED, None, waited_s, shard, attempt)


def error_rows(specs, error: str, shard: int, attempt: int) -> list[dict]:
    """An error row for every choice of every request (specs: jobs.input.line_checks.RequestSpec)."""
    return [error_row(spec, error, shard, attempt, choice) for spec in specs for choice in range(spec.num_rows)]


def cancelled_rows(specs, waited_s: float, shard: int, attempt: int) -> list[dict]:
    """A cancelled row for every choice of every request."""
    return [cancelled_row(spec, waited_s, shard, attempt, choice) for spec in specs
            for choice in range(spec.num_rows)]


def request_outcome(reasons: list[FinishReason]) -> FinishReason:
    """The outcome that counts for a request, from its choices' finish reasons: a failure if
    any failed (retry runs the whole request again), a success if all succeeded, else cancelled."""
    if any(r.is_failure for r in reasons):
        return FinishReason.ERROR
    return FinishReason.STOP if all(r.is_success for r in reasons) else FinishReason.CANCELLED


def shard_totals(rows: list[dict]) -> dict[str, int]:
    """SHARD_TOTALS over a shard's rows: what its commit adds to the ledger. Requests are
    counted once whatever their n (request_outcome), tokens over every choice."""
    choices: dict[str, list[FinishReason]] = {}
    for r in rows:
        choices.setdefault(r["id"], []).append(FinishReason(r["finish_reason"]))
    outcomes = [request_outcome(reasons) for reasons in choices.values()]
    return {"completed_requests": sum(r.is_success for r in outcomes),
            "failed_requests": sum(r.is_failure for r in outcomes),
            **{name: sum(r[name] or 0 for r in rows) for name in SUMMED_COLUMNS}}


def _empty(spec, choice: int, reason: FinishReason, error: str | None, waited_s: float, shard: int,
           attempt: int) -> dict:
    return {"id": spec.id, "choice": choice, "output": "", **dict.fromkeys(SUMMED_COLUMNS, 0),
            "finish_reason": reason.value,
            "error": error, "queue_s": waited_s, "ttft_s": None, "latency_s": waited_s,
            "shard": shard, "attempt": attempt, "valid": None, "tool_call": None, "reasoning": None,
            "reasoning_tokens": None, "model": None,
            "logprobs": None, "embedding": None, "encoding_format": None, "prompt_index": spec.prompt_index(choice),
            **_lineage(spec), "engine": None, "worker": None, "reused_from": None}
