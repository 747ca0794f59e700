"""Connecting to the ledger (SQLite or PostgreSQL) and bringing its schema up to date."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.exc import DBAPIError
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


def newest_revision() -> str | None:
    """The newest migration's revision, read from the file names in migrations/versions
    (`0009_....py` is revision 0009; tests check this is Alembic's head) without importing
    Alembic, which costs a short command such as `pipeline status` a tenth of a second."""
    spec = importlib.util.find_spec("migrations")   # finds the package without running it
    if spec is None or not spec.submodule_search_locations:
        return None
    versions = Path(next(iter(spec.submodule_search_locations))) / "versions"
    names = sorted(p.name.split("_", 1)[0] for p in versions.glob("[0-9]*_*.py"))
    return names[-1] if names else None


def _current_revision(url: str) -> str | None:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
    except DBAPIError:   # no alembic_version table yet: a new ledger
        return None
    finally:
        engine.dispose()


def ensure_schema(url: str) -> None:
    """Upgrade the ledger at url unless it is already at the head revision."""
    if (current := _current_revision(url)) is not None and current == newest_revision():
        return   # the common case, decided without Alembic
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
