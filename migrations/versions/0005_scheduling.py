"""Nightly scheduling: each job's priority, and the timeout its requests get by default.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02

Existing jobs get priority "normal" (as every job had until now) and no request timeout.
"""
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: Union[str, Sequence[str], None] = "0004"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:   # batch: SQLite cannot alter in place
        batch.add_column(sa.Column("priority", sa.String(), nullable=False, server_default="normal"))
        batch.add_column(sa.Column("request_timeout_s", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("request_timeout_s")
        batch.drop_column("priority")
