"""Answering a request from an earlier job's results instead of computing it again.

A shard commit indexes the keys (jobs.request_key) of its requests whose every choice
succeeded (ledger.answers). A later job's shard, before it sends anything to the engine,
looks its requests' keys up (one query per shard) and reads the stored rows from the
result files they name (each file once). A stored answer is used only when its file is
still there and holds a success row for every choice: a result file deleted (`pipeline gc`)
or gone means the request is computed, never served stale. Two jobs computing one key at
the same time both compute it; either answer may be reused later.
"""
from __future__ import annotations

from collections import defaultdict

import pyarrow.parquet as pq

from jobs import ledger
from jobs.paths import JobPaths
from jobs.results import RESULT_SCHEMA
from pipeline.request import FinishReason


def stored_answers(Session, root, job_id: str, specs) -> dict[str, tuple[str, list[dict]]]:
    """For each request of specs (jobs.spec.RequestSpec) with a usable stored answer: its id ->
    (the job whose results hold it, its rows in choice order)."""
    wanted = {spec.key: spec for spec in specs if spec.key is not None}
    if not wanted:
        return {}
    with Session() as s:
        found = ledger.find_answers(s, wanted, exclude_job=job_id)
    by_file: dict[tuple[str, int], set[str]] = defaultdict(set)   # (job, shard) -> request ids to read
    for places in found.values():
        for source, shard, rid in places:
            by_file[source, shard].add(rid)
    stored = {(source, shard): _rows_of(JobPaths(root, source).result_shard(shard), rids)
              for (source, shard), rids in by_file.items()}
    answers = {}
    for spec in specs:
        for source, shard, rid in found.get(spec.key, ()):   # newest first
            rows = stored[source, shard].get(rid)
            if rows is not None and len(rows) == spec.n:
                answers[spec.id] = source, rows
                break
    return answers


def _rows_of(path, request_ids: set[str]) -> dict[str, list[dict]]:
    """The rows of these requests in one result file, those whose every choice (0..n-1) is
    there and succeeded; {} when the file is gone or unreadable."""
    try:
        table = pq.read_table(path, schema=RESULT_SCHEMA, filters=[("id", "in", sorted(request_ids))])
    except (OSError, ValueError):
        return {}
    rows: dict[str, list[dict]] = defaultdict(list)
    for row in table.to_pylist():
        rows[row["id"]].append(row)
    complete = {}
    for rid, choices in rows.items():
        choices.sort(key=lambda r: r["choice"] or 0)
        if ([r["choice"] or 0 for r in choices] == list(range(len(choices)))
                and all(FinishReason(r["finish_reason"]).is_success for r in choices)):
            complete[rid] = choices
    return complete


def answers_of(specs, rows: list[dict]) -> list[tuple[str, str]]:
    """What a shard's commit indexes: (key, id) of each request with a key whose every choice
    succeeded (computed here or reused: the answer is in this job's results either way)."""
    ok: dict[str, bool] = {}
    for row in rows:
        ok[row["id"]] = ok.get(row["id"], True) and FinishReason(row["finish_reason"]).is_success
    return [(spec.key, spec.id) for spec in specs if spec.key is not None and ok.get(spec.id)]
