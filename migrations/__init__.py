"""Alembic migrations of the job ledger.

Usable without an alembic.ini on disk (e.g. from an installed package): the config is
built in code with script_location pointing at this package's directory.
"""
from __future__ import annotations

from pathlib import Path

from alembic.config import Config

SCRIPT_LOCATION = Path(__file__).resolve().parent


def alembic_config(url: str) -> Config:
    """An Alembic Config for the ledger at url."""
    cfg = Config()
    cfg.set_main_option("script_location", str(SCRIPT_LOCATION))
    cfg.set_main_option("path_separator", "os")
    # Config values go through configparser interpolation: escape % (URL-encoded passwords).
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg
