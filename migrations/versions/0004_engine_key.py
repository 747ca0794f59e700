"""The engine each job needs (pipeline.engine_key): its shards go to that key's queue.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01

Existing jobs get the key of their recorded engine options, so that recovery and
retries of jobs submitted before this revision route to the same workers as new ones.
"""
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: Union[str, Sequence[str], None] = "0003"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:   # batch: SQLite cannot alter in place
        batch.add_column(sa.Column("engine_key", sa.String(), nullable=True))
        batch.create_index("ix_jobs_engine_key", ["engine_key"])
    from pipeline.engine_key import engine_key   # torch-free

    jobs = sa.table("jobs", sa.column("id", sa.String), sa.column("engine_options", sa.JSON),
                    sa.column("engine_key", sa.String))
    conn = op.get_bind()
    for job_id, options in conn.execute(sa.select(jobs.c.id, jobs.c.engine_options)).all():
        try:
            key = engine_key(options or {})
        except (TypeError, ValueError):   # options this version no longer accepts: no worker serves them
            key = None
        conn.execute(jobs.update().where(jobs.c.id == job_id).values(engine_key=key))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_index("ix_jobs_engine_key")
        batch.drop_column("engine_key")
