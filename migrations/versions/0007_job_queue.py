"""The queue a job was submitted on, so recovery re-sends its shards there.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01

Workers of several PIPELINE_QUEUE prefixes may share one ledger; a reconciler that
re-sent every job's shards under its own prefix handed them to workers that were never
meant to run them. Existing jobs get no queue (null): they are re-sent, as before, on
the prefix of the process that recovers them.
"""
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: Union[str, Sequence[str], None] = "0006"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:   # batch: SQLite cannot alter in place
        batch.add_column(sa.Column("queue", sa.String(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("queue")
