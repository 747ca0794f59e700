"""Helpers of the shard-runner tests: a job submitted from rows, a shard run with a quick
request first, a cancel, a lease taken over."""
from __future__ import annotations

import json

from sqlalchemy import update

from jobs.ledger import Shard, request_cancel
from jobs.submission import create_job_from_file
from workers.shard_runner import run_shard
import hold


def submit(Session, root, tmp_path, rows, options, shard_size=100):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    job_id, _ = create_job_from_file(Session, root, src, model="tiny", engine_options=options, shard_size=shard_size)
    return job_id


def long_requests(n):
    """Requests the engine is held in (tests/hold.py) until their shard stops: no machine is
    fast enough to finish them before the cancel poll (at 400 tokens an AMX Xeon finished
    three of them before the poll after the cancel, when nothing held them)."""
    return [{"id": f"long{i}", "prompt": "Go", "max_tokens": 64, "ignore_eos": True} for i in range(n)]


def run_with_a_quick_request_first(Session, data_root, tmp_path, engines, options, n_long, then, **kwargs):
    """Run a shard of one quick request and n_long long ones, calling then(Session, job_id)
    once the quick one has finished; returns (job_id, outcome). The engine holds the long
    ones four tokens in until the shard stops them (then's cancel or lost lease seen)."""
    job_id = submit(Session, data_root, tmp_path,
                    [{"id": "quick", "prompt": "Hi", "max_tokens": 1}, *long_requests(n_long)], options)
    on_result = lambda row: then(Session, job_id) if row["id"] == "quick" else None  # noqa: E731
    with hold.installed(prefix="long", group=lambda request_id: "long"):
        return job_id, run_shard(Session, data_root, job_id, 0, engine_provider=engines.use, worker_name="t",
                                 on_result=on_result, **kwargs)


def cancel(Session, job_id):
    with Session() as s:
        request_cancel(s, job_id)


def another_worker_takes_over(Session, job_id):
    with Session() as s:
        s.execute(update(Shard).where(Shard.job_id == job_id).values(attempt=Shard.attempt + 1))
        s.commit()
