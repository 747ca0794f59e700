"""Answers reused across jobs: the index of stored answers, and each job's reuse settings.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-02

`answers` maps a request key (jobs.reuse.answer_key) to the job and shard whose results hold
its answer. Existing jobs keep reuse on but have no fingerprint and no index entries: their
answers are never reused (their rows have no key).
"""
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: Union[str, Sequence[str], None] = "0011"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table(
        "answers",
        sa.Column("job_id", sa.String(), sa.ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("request_id", sa.String(), primary_key=True),
        sa.Column("key", sa.String(), nullable=False),
        sa.Column("shard", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_answers_key", "answers", ["key"])
    with op.batch_alter_table("jobs") as batch:   # batch: SQLite cannot alter in place
        batch.add_column(sa.Column("reuse", sa.Boolean(), nullable=False, server_default=sa.true()))
        batch.add_column(sa.Column("engine_fingerprint", sa.String(), nullable=True))
        batch.add_column(sa.Column("reused_requests", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("reused_requests")
        batch.drop_column("engine_fingerprint")
        batch.drop_column("reuse")
    op.drop_index("ix_answers_key", "answers")
    op.drop_table("answers")
