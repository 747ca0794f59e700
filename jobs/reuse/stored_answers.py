"""Answering a request from an earlier job's results instead of computing it again.

A shard commit indexes the keys (jobs.reuse.answer_key) of its requests whose every choice
succeeded (ledger.answers). At submit, a new job's shards whose every request has a stored
answer are committed from them at once (answer_at_submit: no worker, no engine; a job
answered whole is completed before its submit returns), and only the others are queued.
A worker's shard, before it sends anything to the engine, looks its requests' keys up
(one query per shard) and reads the stored rows from the result files they name (each
file once), so a shard with some changed lines computes only those. A stored answer is
used only when its file is still there and holds a success row for every choice: a
result file deleted (`pipeline gc`) or gone means the request is computed, never served
stale. Two jobs computing one key at the same time both compute it; either answer may be
reused later. Parquet is imported only where rows are read or written, so a submit with
nothing to reuse stays light.
"""
from __future__ import annotations

from collections import defaultdict

from jobs import ledger
from jobs.results import result_row
from jobs.ledger import ShardStatus
from jobs.paths import JobPaths
from jobs.reuse.answer_key import request_key
from jobs.input.request_spec import RequestSpec
from jobs.input.shard_files import read_shard_lines
from jobs.ledger.statuses import SUBMITTER
from pipeline.request import FinishReason


_SUBMIT_LEASE_S = 600


def answer_at_submit(Session, root, job) -> list[int]:
    """Commit each shard of the new job `job` (a ledger.Job, queued) whose every request has a
    usable stored answer, from those answers, under the SUBMITTER's attempt; finish the job if
    that was every shard. Returns the indexes of the shards left to compute, in order.

    Nothing is looked up for a --no-reuse job, one without an engine fingerprint, or one whose
    engine has no stored answers at all (the first night costs nothing). A shard's stored rows
    are read only when every one of its keys was found. A stored answer that cannot be used
    after all (its result file gone) leaves the shard to a worker, which computes it."""
    every = list(range(job.num_shards))
    if not job.reuse:
        return every
    with Session() as s:
        # each shard's engine: a several-model job's shards have their own (ledger.Shard.engine_fingerprint)
        fingerprint_of = ([job.engine_fingerprint] * job.num_shards if job.models is None else
                          [shard.engine_fingerprint for shard in ledger.get_shards(s, job.id)])
        known = {fp for fp in set(fingerprint_of) if fp is not None and ledger.any_answers_of(s, fp, job.answer_scope)}
    if not known:
        return every   # (before Parquet is imported: a first night's submit stays light, pyarrow is 40 MB)
    from jobs.results.finalize import finalize_job
    paths, left = JobPaths(root, job.id), []
    for index in every:
        if fingerprint_of[index] not in known:
            left.append(index)
            continue
        # Keys from the shard's lines as they are, as a worker makes them: the requests
        # themselves are made only for a shard that is answered whole.
        lines = read_shard_lines(paths.input_shard(index))
        keys = [request_key(line, fingerprint_of[index], job.answer_scope) for line in lines]
        found = _found_all(Session, job.id, keys)
        if found is None:
            left.append(index)
            continue
        specs = [RequestSpec.from_dict(line) for line in lines]
        for spec, key in zip(specs, keys):
            spec.key = key
        answers = _usable(root, specs, found)
        if len(answers) < len(specs) or not _commit_reused(Session, paths, job.id, index, specs, answers):
            left.append(index)
    if len(left) < len(every):
        finalize_job(Session, root, job.id)
    return left


def _commit_reused(Session, paths: JobPaths, job_id: str, index: int, specs, answers) -> bool:
    from jobs.results.parquet_files import commit_rows
    with Session() as s:
        attempt = ledger.claim_shard(s, job_id, index, SUBMITTER, _SUBMIT_LEASE_S, max_attempts=1)
    if attempt is None:
        return False
    rows = [result_row.reused(row, spec, index, attempt, answers[spec.id][0])
            for spec in specs for row in answers[spec.id][1]]
    return commit_rows(Session, paths, job_id, index, attempt, rows, ShardStatus.COMPLETED,
                       answers=answers_of(specs, rows))


def _found_all(Session, job_id: str, keys: list[str | None]) -> dict | None:
    """The index's places of every key (ledger.find_answers), or None when one has no key or
    is not found."""
    if not keys or None in keys:
        return None
    with Session() as s:
        found = ledger.find_answers(s, keys, exclude_job=job_id)
    return found if len(found) == len(set(keys)) else None


def stored_answers(Session, root, job_id: str, specs) -> dict[str, tuple[str, list[dict]]]:
    """For each request of specs (jobs.input.line_checks.RequestSpec) with a usable stored answer: its id ->
    (the job whose results hold it, its rows in choice order)."""
    wanted = {spec.key for spec in specs if spec.key is not None}
    if not wanted:
        return {}
    with Session() as s:
        found = ledger.find_answers(s, wanted, exclude_job=job_id)
    return _usable(root, specs, found)


def _usable(root, specs, found: dict) -> dict[str, tuple[str, list[dict]]]:
    """stored_answers' answers from the index's places `found`: each result file read once."""
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
            if rows is not None and len(rows) == spec.num_rows:
                answers[spec.id] = source, rows
                break
    return answers


def _rows_of(path, request_ids: set[str]) -> dict[str, list[dict]]:
    """The rows of these requests in one result file, those whose every choice (0..n-1) is
    there and succeeded; {} when the file is gone or unreadable."""
    import pyarrow.parquet as pq

    from jobs.results.parquet_files import RESULT_SCHEMA
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
