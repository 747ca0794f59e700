"""Deleted files keep their row, marked deleted: a batch's deleted output stays deleted.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01

A batch's output and error files are written the first time the ended batch is looked at,
unless its rows say they were written already; a deleted one used to lose its row and
be written again on the next look. Existing rows are not deleted (null).
"""
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: Union[str, Sequence[str], None] = "0009"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    with op.batch_alter_table("files") as batch:   # batch: SQLite cannot alter in place
        batch.add_column(sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("files") as batch:
        batch.drop_column("deleted_at")
