"""Embedding jobs' stats: the vectors made and vectors per second.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02

Existing jobs made no vectors (0, and null per second).
"""
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: Union[str, Sequence[str], None] = "0010"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:   # batch: SQLite cannot alter in place
        batch.add_column(sa.Column("embedding_vectors", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("vectors_s", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("vectors_s")
        batch.drop_column("embedding_vectors")
