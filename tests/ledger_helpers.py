"""Helpers of the ledger tests (tests/jobs/test_ledger*.py): a job of a few shards, straight
into the ledger."""
from __future__ import annotations

from jobs.ledger import create_job
from jobs.paths import new_job_id


def make_job(Session, sizes=(3, 2), job_id=None):
    job_id = job_id or new_job_id()
    with Session() as s:
        create_job(s, job_id=job_id, model="smollm2", engine_options={"max_batch": 8},
                   input_format="pipeline", endpoint=None, input_path=f"/in/{job_id}",
                   results_path=f"/out/{job_id}", shard_size=3, shard_sizes=list(sizes),
                   metadata={"owner": "tests"})
    return job_id
