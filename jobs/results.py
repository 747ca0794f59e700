"""Result shards as Parquet (schema in docs/contracts.md).

A job's results directory is a Parquet dataset of committed ``shard-*.parquet`` files;
attempts in progress live in ``results/_tmp`` and are never read.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

RESULT_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("output", pa.string()),
    ("prompt_tokens", pa.int32()),
    ("output_tokens", pa.int32()),
    ("finish_reason", pa.string()),  # "stop" | "length" | "error" | "cancelled"
    ("error", pa.string()),
    ("queue_s", pa.float64()),
    ("ttft_s", pa.float64()),
    ("latency_s", pa.float64()),
    ("shard", pa.int32()),
    ("attempt", pa.int32()),
])


def write_shard_tmp(rows: list[dict], tmp_path: str | os.PathLike) -> None:
    """Write rows as one Parquet file and fsync it, ready for ledger.commit_shard to rename."""
    unknown = set().union(*rows) - set(RESULT_SCHEMA.names)
    if unknown:
        raise ValueError(f"result rows have unknown fields: {sorted(unknown)}")
    table = pa.Table.from_pylist(rows, schema=RESULT_SCHEMA)
    tmp_path = Path(tmp_path)
    tmp_path.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp_path, "wb") as f:
        pq.write_table(table, f)
        f.flush()
        os.fsync(f.fileno())


def _dataset(results_dir: str | os.PathLike) -> ds.Dataset | None:
    files = sorted(str(p) for p in Path(results_dir).glob("shard-*.parquet"))
    return ds.dataset(files, schema=RESULT_SCHEMA, format="parquet") if files else None


def read_results(results_dir: str | os.PathLike, columns: list[str] | None = None) -> pa.Table:
    """All committed rows, in shard order (an empty table with the schema if none)."""
    dataset = _dataset(results_dir)
    if dataset is None:
        empty = RESULT_SCHEMA.empty_table()
        return empty.select(columns) if columns is not None else empty
    return dataset.to_table(columns=columns)


def iter_result_rows(results_dir: str | os.PathLike, columns: list[str] | None = None) -> Iterator[dict]:
    """Committed rows as dicts, one record batch in memory at a time."""
    dataset = _dataset(results_dir)
    if dataset is None:
        return
    for batch in dataset.to_batches(columns=columns):
        yield from batch.to_pylist()


def export_jsonl(results_dir: str | os.PathLike, out_path: str | os.PathLike) -> int:
    """Write every committed row as a JSON line to out_path; return the number of rows."""
    out_path = Path(out_path)
    tmp = out_path.with_name(out_path.name + ".tmp")
    n = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for row in iter_result_rows(results_dir):
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    os.replace(tmp, out_path)  # readers never see a half-written export
    return n


def remove_stale_tmp(tmp_dir: str | os.PathLike, older_than_s: float) -> int:
    """Delete files in tmp_dir not modified for older_than_s (attempts of dead workers).

    older_than_s must exceed the lease, so that no live attempt is touched.
    Returns the number of files removed.
    """
    tmp_dir = Path(tmp_dir)
    if not tmp_dir.is_dir():
        return 0
    cutoff = time.time() - older_than_s
    removed = 0
    for path in tmp_dir.iterdir():
        try:
            if path.is_file() and path.stat().st_mtime < cutoff:
                path.unlink()
                removed += 1
        except FileNotFoundError:  # another cleaner or the commit got there first
            continue
    return removed
