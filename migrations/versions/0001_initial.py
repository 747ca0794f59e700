"""Initial ledger schema: jobs and shards.

Revision ID: 0001
Revises:
Create Date: 2025-11-29

Hand-written to match jobs.ledger; tests/jobs/test_ledger.py checks that autogenerate finds
no difference. It does not import jobs.ledger, so later model changes cannot alter it.
"""
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: Union[str, Sequence[str], None] = None
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def _ts(name: str, nullable: bool = True) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def _count(name: str) -> sa.Column:
    return sa.Column(name, sa.Integer(), nullable=False)


def _float(name: str) -> sa.Column:
    return sa.Column(name, sa.Float(), nullable=True)


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("status", sa.String(), nullable=False),
        sa.Column("model", sa.String(), nullable=False),
        sa.Column("engine_options", sa.JSON(), nullable=False),
        sa.Column("input_format", sa.String(), nullable=False),
        sa.Column("endpoint", sa.String(), nullable=True),
        sa.Column("input_path", sa.String(), nullable=False),
        sa.Column("results_path", sa.String(), nullable=False),
        sa.Column("shard_size", sa.Integer(), nullable=False),
        sa.Column("num_shards", sa.Integer(), nullable=False),
        sa.Column("completion_window", sa.String(), nullable=True),
        sa.Column("metadata", sa.JSON(), nullable=True),
        _ts("created_at", nullable=False),
        _ts("started_at"),
        _ts("finalizing_at"),
        _ts("finished_at"),
        _ts("cancelling_at"),
        _ts("expires_at"),
        _count("total_requests"),
        _count("completed_requests"),
        _count("failed_requests"),
        _count("prompt_tokens"),
        _count("output_tokens"),
        _float("wall_seconds"),
        _float("output_tok_s"),
        _float("total_tok_s"),
        _float("latency_p50"),
        _float("latency_p95"),
        _float("latency_p99"),
        _float("ttft_p50"),
        _float("ttft_p95"),
        sa.Column("error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_jobs"),
    )
    op.create_index("ix_jobs_status", "jobs", ["status"])

    op.create_table(
        "shards",
        sa.Column("job_id", sa.String(), nullable=False),
        sa.Column("index", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("status", sa.String(), nullable=False),
        _count("attempt"),
        _count("releases"),
        _count("num_requests"),
        _count("completed_requests"),
        _count("failed_requests"),
        _count("prompt_tokens"),
        _count("output_tokens"),
        sa.Column("worker", sa.String(), nullable=True),
        _ts("lease_expires_at"),
        _ts("heartbeat_at"),
        _ts("started_at"),
        _ts("finished_at"),
        sa.Column("error", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name="fk_shards_job_id_jobs", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "index", name="pk_shards"),
    )
    op.create_index("ix_shards_status_lease", "shards", ["status", "lease_expires_at"])


def downgrade() -> None:
    op.drop_index("ix_shards_status_lease", table_name="shards")
    op.drop_table("shards")
    op.drop_index("ix_jobs_status", table_name="jobs")
    op.drop_table("jobs")
