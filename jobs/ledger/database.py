"""Connecting to the ledger (SQLite or PostgreSQL) and bringing its schema up to date."""
from __future__ import annotations

from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker


def make_engine(url: str) -> Engine:
    """An engine for the ledger at url."""
    url = make_url(url)
    if url.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True)
    if url.database and url.database != ":memory:":
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _sqlite_pragmas(dbapi_conn, _record) -> None:
        # WAL lets readers run beside the writer; busy_timeout makes writers queue, not fail.
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    return engine


def session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions whose objects stay readable after the commit each ledger function ends with."""
    return sessionmaker(engine, expire_on_commit=False)


def upgrade(url: str, revision: str = "head") -> None:
    """Run the Alembic migrations up to revision (no alembic.ini needed)."""
    from alembic import command

    from migrations import alembic_config
    command.upgrade(alembic_config(url), revision)


def ensure_schema(url: str) -> None:
    """Upgrade the ledger at url unless it is already at the head revision."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    from migrations import alembic_config
    head = ScriptDirectory.from_config(alembic_config(url)).get_current_head()
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            current = MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()
    if current != head:
        upgrade(url)


def open_sessions(url: str) -> sessionmaker[Session]:
    """Sessions on the ledger at url, its schema brought up to date first."""
    ensure_schema(url)
    return session_factory(make_engine(url))
