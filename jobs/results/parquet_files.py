"""Result shards as Parquet (the row and its schema: jobs.results.result_row).

A job's results directory is a Parquet dataset of committed ``shard-*.parquet`` files;
attempts in progress live in ``results/_tmp`` and are never read.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from jobs.atomic_files import atomic_write, write_durably
from jobs import ledger
from jobs.results import result_row
from jobs.paths import JobPaths, result_shard_files
from jobs.results.result_row import RESULT_COLUMNS
from jobs.input.shard_files import read_shard

_TOKEN = [("token", pa.string()), ("logprob", pa.float32()), ("bytes", pa.list_(pa.int32()))]
# A list per row of {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}: OpenAI's
# chat logprobs, queryable as nested columns (DuckDB: unnest(logprobs)).
TOKEN_LOGPROBS = pa.list_(pa.struct([*_TOKEN, ("top_logprobs", pa.list_(pa.struct(_TOKEN)))]))
# An embedding: DuckDB reads it as FLOAT[] (cast to FLOAT[384] for its array functions), pandas
# and pyarrow as a list of float32 (pyarrow.compute.list_flatten + reshape gives a matrix).
VECTOR = pa.list_(pa.float32())
_NESTED = {"token_logprobs": TOKEN_LOGPROBS, "vector": VECTOR}
RESULT_SCHEMA = pa.schema([(name, _NESTED[t] if t in _NESTED else getattr(pa, t)()) for name, t in RESULT_COLUMNS])


def write_shard_tmp(rows: list[dict], tmp_path: str | os.PathLike) -> None:
    """Write rows as one Parquet file and fsync it, ready for ledger.commit_shard to rename."""
    table = _table(rows)
    with write_durably(tmp_path, "wb") as f:
        pq.write_table(table, f)


def commit_rows(Session, paths: JobPaths, job_id: str, index: int, attempt: int, rows: list[dict], status: str,
                answers=(), tmp_path: str | os.PathLike | None = None, usage: dict | None = None,
                totals: dict[str, int] | None = None) -> bool:
    """Commit an attempt's rows as shard `index` (ledger.commit_shard: the fenced ledger update,
    with the attempt's usage if it was charged, the rename, the answers indexed); False when the
    attempt lost its lease. totals: result_row.shard_totals(rows) when the caller made it already."""
    tmp = tmp_path or paths.tmp_result(index, attempt)
    write_shard_tmp(rows, tmp)
    if totals is None:
        totals = result_row.shard_totals(rows)
    with Session() as s:
        return ledger.commit_shard(s, job_id, index, attempt, totals=totals, tmp_path=tmp,
                                   final_path=paths.result_shard(index), status=status, answers=answers,
                                   usage=usage)


def write_final_shard(rows: list[dict], path: str | os.PathLike) -> None:
    """Write rows straight to a shard's committed place, whole or not at all, through a hidden
    file beside it: the finalizer's rows of shards that never ran (no attempt can commit
    then). Not through results/_tmp, whose files of shards not running the recovery sweep
    removes."""
    table = _table(rows)
    with atomic_write(path, "wb", overwrite=False) as f:
        pq.write_table(table, f)


def _table(rows: list[dict]) -> pa.Table:
    unknown = set().union(*rows) - set(RESULT_SCHEMA.names)
    if unknown:
        raise ValueError(f"result rows have unknown fields: {sorted(unknown)}")
    return pa.Table.from_pylist(rows, schema=RESULT_SCHEMA)


# A dataset keeps every file's parsed footer until it is dropped (about 100 KB a shard file:
# reading one column of a 3,908-shard job held 490 MB), so results are scanned in groups of files.
_FILES_A_SCAN = 256


def _datasets(results_dir: str | os.PathLike) -> Iterator[ds.Dataset]:
    """The committed shard files as datasets of at most _FILES_A_SCAN files, in shard order."""
    files = [str(p) for p in result_shard_files(results_dir)]
    for at in range(0, len(files), _FILES_A_SCAN):
        yield ds.dataset(files[at:at + _FILES_A_SCAN], schema=RESULT_SCHEMA, format="parquet")


def read_results(results_dir: str | os.PathLike, columns: list[str] | dict[str, pc.Expression] | None = None,
                 ) -> pa.Table:
    """All committed rows, in shard order (an empty table with the schema if none). columns:
    names, or {name: expression of columns}, evaluated a record batch at a time, so that only
    the results are held (the stats count a million vectors without reading them into memory)."""
    tables = [dataset.to_table(columns=columns) for dataset in _datasets(results_dir)]
    return pa.concat_tables(tables) if tables else ds.dataset(RESULT_SCHEMA.empty_table()).to_table(columns=columns)


def iter_result_rows(results_dir: str | os.PathLike, columns: list[str] | None = None) -> Iterator[dict]:
    """Committed rows as dicts, one record batch in memory at a time."""
    for dataset in _datasets(results_dir):
        for batch in dataset.to_batches(columns=columns):
            yield from batch.to_pylist()


def iter_job_rows(job_paths: JobPaths, num_shards: int) -> Iterator[dict]:
    """A row for every request of a job, in input order: each shard's committed rows, or for a
    shard that never ran (one a cancel or an expiry left) a cancelled row per request (and choice) of its
    input, so that exports name every request. A shard whose input is gone too is skipped."""
    for index in range(num_shards):
        final = job_paths.result_shard(index)
        if final.exists():
            yield from pq.read_table(final, schema=RESULT_SCHEMA).to_pylist()
            continue
        try:
            specs = read_shard(job_paths.input_shard(index))
        except OSError:
            continue
        yield from result_row.cancelled_rows(specs, 0.0, index, 0)


def export_jsonl(results_dir: str | os.PathLike, out_path: str | os.PathLike, *, overwrite: bool = False) -> int:
    """Write every committed row as a JSON line to out_path (atomically); return the number of rows.

    An existing out_path is replaced only with overwrite (jobs.atomic_files.TargetExists otherwise).
    """
    n = 0
    with atomic_write(out_path, overwrite=overwrite) as f:
        for row in iter_result_rows(results_dir):
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    return n
