"""Retention: how long a job's results and an upload are kept, and when they went.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-06

`jobs.keep_seconds` is how long a job's results are kept once it ended (`pipeline submit
--keep`, a batch's `output_expires_after`, PIPELINE_KEEP_RESULTS; null: for ever, as every
job before this one); `jobs.results_expired_at` is when the recovery sweep deleted them (the row
stays). `files.expires_at` is when an upload (`expires_after`) or a batch's output file goes.
"""
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: Union[str, Sequence[str], None] = "0014"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("keep_seconds", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("results_expired_at", sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table("files") as batch:
        batch.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("files") as batch:
        batch.drop_column("expires_at")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("results_expired_at")
        batch.drop_column("keep_seconds")
