"""Prefix-cache statistics: cached prompt tokens per shard and job, the job's hit rate.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29

Existing rows get 0 cached tokens (nothing was cached before) and no hit rate.
"""
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: Union[str, Sequence[str], None] = "0001"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    for table in ("jobs", "shards"):
        with op.batch_alter_table(table) as batch:   # batch: SQLite cannot alter in place
            batch.add_column(sa.Column("cached_tokens", sa.Integer(), nullable=False, server_default="0"))
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("prefix_hit_rate", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("prefix_hit_rate")
    for table in ("jobs", "shards"):
        with op.batch_alter_table(table) as batch:
            batch.drop_column("cached_tokens")
