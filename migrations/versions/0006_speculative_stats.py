"""Speculative decoding statistics: a job's drafted and accepted tokens, its acceptance rate.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01

Existing rows get 0 drafted and accepted tokens (nothing was drafted before) and no rate.
(Branched from 0002; chain it after the current head when merging.)
"""
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: Union[str, Sequence[str], None] = "0005"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:   # batch: SQLite cannot alter in place
        batch.add_column(sa.Column("draft_tokens", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("accepted_tokens", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("acceptance_rate", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("acceptance_rate")
        batch.drop_column("accepted_tokens")
        batch.drop_column("draft_tokens")
