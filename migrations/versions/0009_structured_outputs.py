"""Structured outputs: a job's constrained answers, and how many were complete under their grammar.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01

Existing jobs had no constrained requests: 0 and 0.
"""
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: Union[str, Sequence[str], None] = "0008"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:   # batch: SQLite cannot alter in place
        batch.add_column(sa.Column("constrained_requests", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("constrained_valid", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("constrained_valid")
        batch.drop_column("constrained_requests")
