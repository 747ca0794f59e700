"""Job statistics computed from result shards (jobs.results.job_stats)."""
from __future__ import annotations

import os

import pyarrow.parquet as pq
import pytest

from jobs.paths import JobPaths
from jobs.results.parquet_files import write_shard_tmp
from jobs.results.job_stats import STATS_SCHEMA, compute_stats, write_stats

JOB = "job_00000000000000aa"


@pytest.fixture
def jp(data_root):
    return JobPaths(data_root, JOB)


def publish(jp, shard, rows):
    write_shard_tmp(rows, jp.tmp_result(shard, 1))
    os.replace(jp.tmp_result(shard, 1), jp.result_shard(shard))


def ok_row(i):
    # Latencies 1..100 s and ttft 0.01..1.00 s, split over two shards below.
    return {"id": f"r{i}", "output": "x", "prompt_tokens": 10, "output_tokens": 20, "cached_tokens": 4,
            "draft_tokens": 8, "accepted_tokens": 6, "finish_reason": "length" if i % 10 == 0 else "stop", "latency_s": float(i),
            "ttft_s": i / 100, "shard": i % 2, "attempt": 1}


def test_compute_stats_on_known_numbers(jp):
    rows = [ok_row(i) for i in range(1, 101)]
    errors = [{"id": "e1", "finish_reason": "error", "error": "boom", "prompt_tokens": 10,
               "output_tokens": 0, "latency_s": 999.0, "shard": 0, "attempt": 1}]
    cancelled = [{"id": "c1", "finish_reason": "cancelled", "prompt_tokens": 10,
                  "output_tokens": 5, "latency_s": 500.0, "ttft_s": 0.5, "shard": 1, "attempt": 1}]
    publish(jp, 0, [r for r in rows if r["shard"] == 0] + errors)
    publish(jp, 1, [r for r in rows if r["shard"] == 1] + cancelled)

    stats = compute_stats(jp.results_dir, wall_seconds=10.0)
    assert stats == pytest.approx({
        "total_requests": 102, "completed_requests": 100, "failed_requests": 1,
        "prompt_tokens": 1020, "output_tokens": 2005, "wall_seconds": 10.0,
        # Only the 100 successful rows say they hit the prefix cache (4 tokens each).
        "cached_tokens": 400, "prefix_hit_rate": 400 / 1020,
        # Speculative decoding: 8 drafted, 6 accepted in each successful row.
        "draft_tokens": 800, "accepted_tokens": 600, "acceptance_rate": 0.75,
        "constrained_requests": 0, "constrained_valid": 0,   # no structured-output rows here
        "embedding_vectors": 0, "vectors_s": None,             # nor embeddings
        "reused_requests": 0,                                  # nor reused answers
        "output_tok_s": 200.5, "total_tok_s": 302.5,
        # numpy's linear interpolation over 1..100: error and cancelled rows are excluded.
        "latency_p50": 50.5, "latency_p95": 95.05, "latency_p99": 99.01,
        "ttft_p50": 0.505, "ttft_p95": 0.9505,
        # energy and cost come from the ledger's shards (jobs.ledger.job_usage): none given here
        "joules": None, "tokens_per_joule": None, "device_seconds": None, "cost": None,
    })
    measured = compute_stats(jp.results_dir, 10.0, {"joules": 50.0, "device_seconds": 4.0, "cost": None,
                                                    "energy_unmeasured": None})
    assert measured["tokens_per_joule"] == pytest.approx(3025 / 50.0)   # prompt and output tokens computed
    assert (measured["joules"], measured["device_seconds"], measured["cost"]) == (50.0, 4.0, None)


def test_compute_stats_without_results(jp):
    stats = compute_stats(jp.results_dir, wall_seconds=0.0)
    assert stats["total_requests"] == stats["completed_requests"] == stats["output_tokens"] == 0
    assert stats["output_tok_s"] is None and stats["total_tok_s"] is None
    assert stats["cached_tokens"] == 0 and stats["prefix_hit_rate"] is None
    assert stats["draft_tokens"] == 0 and stats["acceptance_rate"] is None
    assert stats["latency_p50"] is None and stats["ttft_p95"] is None


def test_ttft_percentiles_ignore_rows_without_a_token(jp):
    publish(jp, 0, [dict(ok_row(1), ttft_s=None), dict(ok_row(2), ttft_s=0.3)])
    stats = compute_stats(jp.results_dir, wall_seconds=1.0)
    assert stats["ttft_p50"] == stats["ttft_p95"] == pytest.approx(0.3)
    assert stats["latency_p50"] == pytest.approx(1.5)


def test_write_stats_is_one_row(jp):
    publish(jp, 0, [ok_row(i) for i in range(1, 5)])
    stats = compute_stats(jp.results_dir, wall_seconds=2.0)
    write_stats(stats, JOB, jp.stats_file)
    table = pq.read_table(jp.stats_file)
    assert table.schema == STATS_SCHEMA and table.num_rows == 1
    assert table.to_pylist()[0] == {"job_id": JOB, **stats}
    assert [p.name for p in jp.dir.iterdir() if p.is_file()] == ["stats.parquet"]


def test_results_written_before_cached_tokens_existed_count_as_uncached(jp):
    """A result file without the cached_tokens column (an older version's) still reads."""
    import pyarrow as pa
    old = pa.Table.from_pylist([{"id": "old", "output": "x", "prompt_tokens": 7, "output_tokens": 3,
                                 "finish_reason": "stop", "latency_s": 1.0, "shard": 0, "attempt": 1}])
    jp.results_dir.mkdir(parents=True, exist_ok=True)
    pq.write_table(old, jp.result_shard(0))
    publish(jp, 1, [ok_row(1)])
    stats = compute_stats(jp.results_dir, wall_seconds=1.0)
    assert (stats["prompt_tokens"], stats["cached_tokens"]) == (17, 4)
    assert (stats["draft_tokens"], stats["accepted_tokens"]) == (8, 6)   # null in the old file
    assert stats["prefix_hit_rate"] == pytest.approx(4 / 17)


def test_vectors_are_counted_and_the_reused_ones_left_out_of_the_rate(jp):
    def vector_row(i, reused_from=None):
        return {"id": f"d{i}", "prompt_tokens": 5, "output_tokens": 0, "finish_reason": "stop", "latency_s": 1.0,
                "embedding": [float(i)] * 4, "reused_from": reused_from, "shard": 0, "attempt": 1}
    failed = {"id": "bad", "prompt_tokens": 9, "finish_reason": "error", "error": "too long", "latency_s": 0.1,
              "shard": 0, "attempt": 1}
    publish(jp, 0, [vector_row(i) for i in range(6)] + [vector_row(6, "job_00000000000000bb"), failed])
    stats = compute_stats(jp.results_dir, wall_seconds=2.0)
    assert (stats["embedding_vectors"], stats["vectors_s"], stats["reused_requests"]) == (7, 3.0, 1)
    assert (stats["total_requests"], stats["completed_requests"], stats["failed_requests"]) == (8, 7, 1)
