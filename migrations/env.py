"""Alembic environment for the job ledger (programmatic via jobs.ledger.upgrade, or `alembic`)."""
from logging.config import fileConfig

from alembic import context
from sqlalchemy.engine import Connection, make_url

from jobs.ledger import Base, make_engine
from jobs.settings import Settings

config = context.config
if config.config_file_name and config.file_config.has_section("loggers"):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

URL = config.get_main_option("sqlalchemy.url") or Settings.from_env().database_url


def _configure(**kwargs) -> None:
    context.configure(
        target_metadata=Base.metadata,
        compare_type=True,
        # SQLite cannot ALTER most things; batch mode rebuilds the table instead.
        render_as_batch=make_url(URL).get_backend_name() == "sqlite",
        **kwargs,
    )


def run_offline() -> None:
    _configure(url=URL, literal_binds=True, dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


def _run(connection: Connection) -> None:
    _configure(connection=connection)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = make_engine(URL)
    try:
        with engine.connect() as conn:
            _run(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
