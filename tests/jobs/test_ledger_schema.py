"""The ledger's schema on real SQLite and PostgreSQL: created and upgraded idempotently, its
migrations matching the models and going down and up keeping the jobs, aware datetimes only,
and the API keys stored hashed."""
from __future__ import annotations

from datetime import datetime

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, update

from jobs.ledger import Base, Job, Shard, ensure_schema, get_job, jobs_of_key, make_engine, upgrade
from ledger_helpers import downgraded_schema, make_job


def test_upgrade_twice_is_a_noop(db_url, ledger):
    engine, Session = ledger
    job_id = make_job(Session)
    upgrade(db_url)
    ensure_schema(db_url)
    assert {"jobs", "shards", "alembic_version"} <= set(inspect(engine).get_table_names())
    with Session() as s:
        assert get_job(s, job_id) is not None


def test_ensure_schema_creates_a_fresh_sqlite_ledger(tmp_path):
    url = f"sqlite:///{tmp_path / 'fresh' / 'ledger.sqlite'}"
    ensure_schema(url)
    assert (tmp_path / "fresh" / "ledger.sqlite").exists()
    ensure_schema(url)


def test_migration_matches_the_models(ledger):
    engine, _ = ledger
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"compare_type": True})
        assert compare_metadata(context, Base.metadata) == []


def test_naive_datetimes_are_refused(ledger):
    _, Session = ledger
    job_id = make_job(Session)
    with Session() as s, pytest.raises(Exception, match="naive datetime"):
        s.execute(update(Shard).where(Shard.job_id == job_id).values(heartbeat_at=datetime.now()))


def test_api_keys_are_stored_hashed_found_only_while_live(ledger):
    from jobs.ledger import KeyNameTaken, add_key, find_key, list_keys, revoke_key

    _, Session = ledger
    with Session() as s:
        row, key = add_key(s, "team-a")
        other, _ = add_key(s, "team-b")
        assert key.startswith("sk-pipeline-") and key not in row.key_sha256 and len(row.key_sha256) == 64
        assert find_key(s, key).id == row.id and find_key(s, key + "x") is None and find_key(s, "") is None
        with pytest.raises(KeyNameTaken):
            add_key(s, "team-a")
        assert revoke_key(s, "team-a").revoked_at is not None
        assert find_key(s, key) is None and revoke_key(s, row.id) is None   # already revoked
        assert [k.name for k in list_keys(s)] == ["team-a", "team-b"]
        job_id = make_job(Session)
        s.execute(update(Job).where(Job.id == job_id).values(api_key_id=other.id))
        s.commit()
        assert [j.id for j in jobs_of_key(s, other.id)] == [job_id] and jobs_of_key(s, row.id) == []


def test_migration_0003_goes_down_and_up_keeping_the_jobs(db_url, ledger):
    _, Session = ledger
    job_id = make_job(Session)
    schema = downgraded_schema(db_url, "0002")
    assert "api_keys" not in schema
    assert "api_key_id" not in schema["jobs"]
    upgrade(db_url)
    with Session() as s:
        assert get_job(s, job_id).api_key_id is None


def test_migration_0004_gives_existing_jobs_the_key_of_their_engine(db_url, ledger):
    """Jobs made before engine keys existed route like new ones once the ledger is upgraded;
    a job whose recorded options are no longer valid gets no key (no worker serves it)."""
    _, Session = ledger
    from alembic import command

    from migrations import alembic_config
    from pipeline.engine_key import engine_key

    valid = make_job(Session)
    invalid = make_job(Session)   # make_job records {"max_batch": 8}: not an engine option any more
    with Session() as s:
        s.execute(update(Job).where(Job.id == valid).values(engine_options={"model": "/m/tiny", "dtype": "float32"}))
        s.commit()
    command.downgrade(alembic_config(db_url), "0003")
    engine = make_engine(db_url)
    try:
        assert "engine_key" not in {c["name"] for c in inspect(engine).get_columns("jobs")}
    finally:
        engine.dispose()
    upgrade(db_url)
    with Session() as s:
        assert get_job(s, valid).engine_key == engine_key({"model": "/m/tiny", "dtype": "float32"})
        assert get_job(s, invalid).engine_key is None


def test_the_newest_revision_by_file_name_is_alembics_head():
    """ensure_schema's fast path (no Alembic import) trusts the file names: they must agree."""
    from alembic.script import ScriptDirectory

    from jobs.ledger.database import newest_revision
    from migrations import alembic_config

    assert newest_revision() == ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
