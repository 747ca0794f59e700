"""Job statistics from the committed results (same figures as the ledger's stats columns)."""
from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from jobs.atomic_files import atomic_write
from jobs.results.result_row import SUMMED_COLUMNS
from jobs.results.parquet_files import read_results
from pipeline.request import FinishReason

_SUCCESSES = pa.array([reason.value for reason in FinishReason if reason.is_success])
_FAILURES = pa.array([reason.value for reason in FinishReason if reason.is_failure])

_INT_KEYS = ("total_requests", "completed_requests", "failed_requests", *SUMMED_COLUMNS,
             "constrained_requests", "constrained_valid", "embedding_vectors", "reused_requests")
_FLOAT_KEYS = ("prefix_hit_rate", "acceptance_rate", "wall_seconds", "output_tok_s", "total_tok_s", "vectors_s",
               "latency_p50", "latency_p95", "latency_p99", "ttft_p50", "ttft_p95",
               "joules", "tokens_per_joule", "device_seconds", "cost")
STATS_SCHEMA = pa.schema([("job_id", pa.string())]
                         + [(k, pa.int64()) for k in _INT_KEYS]
                         + [(k, pa.float64()) for k in _FLOAT_KEYS])


def compute_stats(results_dir: str | os.PathLike, wall_seconds: float, usage: dict | None = None) -> dict:
    """Counts, token totals, throughput and latency percentiles of a job's results.

    total_requests counts requests (a request with n choices has n rows: tokens count over
    all of them); completed are those whose every choice finished by "stop" or "length",
    failed those with an "error" or "timeout" choice (jobs.results.result_row.request_outcome;
    cancelled ones count in the total only). Percentiles
    (linear interpolation) are over completed rows, so that truncated cancelled requests
    do not skew them; None when there are none. prefix_hit_rate is the share of prompt
    tokens served from the engine's prefix cache (None without prompt tokens). acceptance_rate
    is the share of speculative draft tokens accepted (None when nothing was drafted).
    constrained_requests counts the structured-output answers, constrained_valid those
    complete under their grammar. embedding_vectors counts the vectors made (an embedding
    request's inputs; its prompt tokens are the inputs' tokens). reused_requests counts the
    requests answered from earlier jobs' results (jobs.reuse.stored_answers): the token totals include their
    tokens, but throughputs and percentiles are over the rows computed for this job only, so
    they stay what the engine did. Throughputs are None unless wall_seconds > 0.
    usage: the job's energy and cost from its shards (jobs.ledger.job_usage), kept as they are
    (None without it), with tokens_per_joule: the prompt and output tokens computed for the job
    per joule (None without joules).
    """
    names = ["id", "choice", *SUMMED_COLUMNS, "finish_reason", "ttft_s", "latency_s", "valid", "reused_from"]
    # Whether a row has a vector, not the vectors: 1,000,000 of 384 floats would be 1.5 GB.
    table = read_results(results_dir, columns={**{name: pc.field(name) for name in names},
                                               "has_embedding": pc.field("embedding").is_valid()})
    reason = table["finish_reason"]
    ok = pc.fill_null(pc.is_in(reason, value_set=_SUCCESSES), False)
    failed = pc.is_in(reason, value_set=_FAILURES)
    computed = pc.is_null(table["reused_from"])
    sums = {name: _sum(table[name]) for name in SUMMED_COLUMNS}
    prompt_tokens = sums["prompt_tokens"]
    cached_tokens, draft_tokens, accepted_tokens = sums["cached_tokens"], sums["draft_tokens"], sums["accepted_tokens"]
    computed_prompt, computed_output = (_sum(table[name].filter(computed)) for name in ("prompt_tokens", "output_tokens"))
    computed_ok = pc.and_(ok, computed)
    latency = _percentiles(table["latency_s"].filter(computed_ok), (50, 95, 99))
    ttft = _percentiles(table["ttft_s"].filter(computed_ok), (50, 95))
    vectors = _sum(table["has_embedding"].filter(computed))
    return {
        **_request_counts(table, ok, failed),
        **sums,
        "constrained_requests": pc.count(table["valid"]).as_py() or 0,   # nulls (free text) not counted
        "constrained_valid": pc.sum(table["valid"]).as_py() or 0,
        "embedding_vectors": _sum(table["has_embedding"]),
        "reused_requests": pc.count_distinct(table["id"].filter(pc.invert(computed))).as_py() or 0,
        "prefix_hit_rate": cached_tokens / prompt_tokens if prompt_tokens else None,
        "acceptance_rate": accepted_tokens / draft_tokens if draft_tokens else None,
        "wall_seconds": float(wall_seconds),
        "output_tok_s": _per_second(computed_output, wall_seconds),
        "total_tok_s": _per_second(computed_prompt + computed_output, wall_seconds),
        "vectors_s": _per_second(vectors, wall_seconds) if vectors else None,
        "latency_p50": latency[0], "latency_p95": latency[1], "latency_p99": latency[2],
        "ttft_p50": ttft[0], "ttft_p95": ttft[1],
        **_energy(usage or {}, computed_prompt + computed_output),
    }


def model_counts(results_dir: str | os.PathLike, models: list[dict], shard_models: list[int]) -> list[dict]:
    """A job of several models' figures per model: each entry of `models` (jobs.models) with its
    requests (total, completed, failed: as compute_stats counts them) and tokens (prompt, output,
    reused ones included). shard_models: the index in `models` of each shard's model."""
    table = read_results(results_dir, columns={name: pc.field(name) for name in
                                               ("id", "choice", "shard", "prompt_tokens", "output_tokens",
                                                "finish_reason")})
    model_of_row = pc.take(pa.array(shard_models, pa.int32()), table["shard"])
    counts = []
    for index, model in enumerate(models):
        mine = table.filter(pc.equal(model_of_row, index))
        reason = mine["finish_reason"]
        ok = pc.fill_null(pc.is_in(reason, value_set=_SUCCESSES), False)
        counts.append({**model, **_request_counts(mine, ok, pc.is_in(reason, value_set=_FAILURES)),
                       "prompt_tokens": _sum(mine["prompt_tokens"]), "output_tokens": _sum(mine["output_tokens"])})
    return counts


def _energy(usage: dict, computed_tokens: int) -> dict:
    """The job's energy and cost figures (None: not measured), with why not, when given."""
    joules = usage.get("joules")
    return {**usage, **{k: usage.get(k) for k in ("joules", "device_seconds", "cost")},
            "tokens_per_joule": computed_tokens / joules if joules else None}


def _request_counts(table: pa.Table, ok: pa.ChunkedArray, failed: pa.ChunkedArray) -> dict[str, int]:
    """total, completed and failed requests; per row unless some request has several choices."""
    if not (pc.max(table["choice"]).as_py() or 0):
        return {"total_requests": table.num_rows, "completed_requests": pc.sum(ok).as_py() or 0,
                "failed_requests": pc.sum(failed).as_py() or 0}
    per_request = pa.table({"id": table["id"], "ok": ok, "failed": failed}).group_by("id").aggregate(
        [("ok", "all"), ("failed", "any")])
    return {"total_requests": per_request.num_rows,
            "completed_requests": pc.sum(per_request["ok_all"]).as_py() or 0,   # all ok: none failed
            "failed_requests": pc.sum(per_request["failed_any"]).as_py() or 0}


def write_stats(stats: dict, job_id: str, stats_file: str | os.PathLike) -> None:
    """Write stats as a one-row Parquet file, atomically."""
    row = {"job_id": job_id, **{k: stats.get(k) for k in _INT_KEYS + _FLOAT_KEYS}}
    table = pa.Table.from_pylist([row], schema=STATS_SCHEMA)
    with atomic_write(stats_file, "wb") as f:
        pq.write_table(table, f)


def _sum(column: pa.ChunkedArray) -> int:
    return int(pc.sum(column).as_py() or 0)


def _per_second(n: int, wall_seconds: float) -> float | None:
    return n / wall_seconds if wall_seconds and wall_seconds > 0 else None


def _percentiles(column: pa.ChunkedArray, qs: tuple[int, ...]) -> list[float | None]:
    values = column.drop_null().to_numpy()
    if values.size == 0:
        return [None] * len(qs)
    return [float(v) for v in np.percentile(values, qs)]
