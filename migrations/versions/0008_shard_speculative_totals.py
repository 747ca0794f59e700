"""Each shard's drafted and accepted speculative tokens, as the job already has.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01

A shard commit now adds every summed result column (jobs.results.result_row.SHARD_TOTALS) to its
shard and job; existing shards get 0 (their jobs' totals came from the stats).
"""
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: Union[str, Sequence[str], None] = "0007"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    with op.batch_alter_table("shards") as batch:   # batch: SQLite cannot alter in place
        batch.add_column(sa.Column("draft_tokens", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("accepted_tokens", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("shards") as batch:
        batch.drop_column("accepted_tokens")
        batch.drop_column("draft_tokens")
