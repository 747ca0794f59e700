"""Helpers of the ledger tests (tests/jobs/test_ledger*.py): a job of a few shards, straight
into the ledger; a job whose one worker died holding its shard; a ledger's one job and its shards; the
schema a migration's downgrade leaves."""
from __future__ import annotations

from datetime import timedelta

from sqlalchemy import update

from jobs.ledger import Shard, claim_shard, create_job, utcnow
from jobs.paths import new_job_id
from jobs.submission import create_job_from_file
from cluster import write_jsonl


def make_job(Session, sizes=(3, 2), job_id=None):
    job_id = job_id or new_job_id()
    with Session() as s:
        create_job(s, job_id=job_id, model="smollm2", engine_options={"max_batch": 8},
                   input_format="pipeline", endpoint=None, input_path=f"/in/{job_id}",
                   results_path=f"/out/{job_id}", shard_size=3, shard_sizes=list(sizes),
                   metadata={"owner": "tests"})
    return job_id


def job_of_a_dead_worker(Session, data_root, tmp_path) -> str:
    """A 3-request, 1-shard job whose shard a worker ("gone:1") claimed on its one attempt and
    whose lease expired 5 s ago: what the reaper finds after a worker dies mid-shard."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": "Hi"} for i in range(3)])
    job_id = create_job_from_file(Session, data_root, src, model="tiny", engine_options={}, shard_size=3)[0]
    with Session() as s:
        assert claim_shard(s, job_id, 0, "gone:1", 60, 1) == 1
        s.execute(update(Shard).values(lease_expires_at=utcnow() - timedelta(seconds=5)))
        s.commit()
    return job_id


def downgraded_schema(db_url: str, revision: str) -> dict[str, set[str]]:
    """Downgrade the ledger at db_url to `revision`: its tables there, each with its column names."""
    from alembic import command
    from sqlalchemy import inspect

    from jobs.ledger import make_engine
    from migrations import alembic_config

    command.downgrade(alembic_config(db_url), revision)
    engine = make_engine(db_url)
    try:
        inspector = inspect(engine)
        return {table: {c["name"] for c in inspector.get_columns(table)} for table in inspector.get_table_names()}
    finally:
        engine.dispose()


def the_job_and_its_shards(db_url: str):
    """The ledger at db_url's one job, and its shards."""
    from jobs.ledger import get_shards, list_jobs, make_engine, session_factory

    engine = make_engine(db_url)
    try:
        with session_factory(engine)() as s:
            (job,) = list_jobs(s)
            return job, get_shards(s, job.id)
    finally:
        engine.dispose()
