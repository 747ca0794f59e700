"""Webhooks: the endpoints jobs' ends are posted to, and each delivery's state.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-06

`webhook_endpoints` holds an API key's endpoint (`pipeline keys webhook NAME URL`) or one
that CLI jobs name (`pipeline submit --notify URL`), with the secret that signs its
deliveries; `jobs.webhook_endpoint_id` is a CLI job's. `webhook_deliveries` is one event to
one endpoint: pending until a 2xx, retried with backoff for a day (workers.webhook_sender).
`jobs.finished_at` is indexed: the sender asks for the jobs that ended lately. Existing jobs
have no endpoint, and no event is made for a job that ended before its endpoint existed.
"""
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: Union[str, Sequence[str], None] = "0013"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table(
        "webhook_endpoints",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("url", sa.String(), nullable=False),
        sa.Column("secret", sa.String(), nullable=False),
        sa.Column("api_key_id", sa.String(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("disabled_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["api_key_id"], ["api_keys.id"], name="fk_webhook_endpoints_api_key_id_api_keys"),
        sa.PrimaryKeyConstraint("id", name="pk_webhook_endpoints"),
    )
    op.create_index("ix_webhook_endpoints_api_key_id", "webhook_endpoints", ["api_key_id"])
    op.create_table(
        "webhook_deliveries",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("job_id", sa.String(), nullable=False),
        sa.Column("type", sa.String(), nullable=False),
        sa.Column("endpoint_id", sa.String(), nullable=False),
        sa.Column("payload", sa.Text(), nullable=False),
        sa.Column("status", sa.String(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("delivered_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name="fk_webhook_deliveries_job_id_jobs", ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["endpoint_id"], ["webhook_endpoints.id"],
                                name="fk_webhook_deliveries_endpoint_id_webhook_endpoints"),
        sa.PrimaryKeyConstraint("id", name="pk_webhook_deliveries"),
        sa.UniqueConstraint("job_id", "type", "endpoint_id", name="uq_webhook_deliveries_job_id_type_endpoint_id"),
    )
    op.create_index("ix_webhook_deliveries_job_id", "webhook_deliveries", ["job_id"])
    op.create_index("ix_webhook_deliveries_status_next", "webhook_deliveries", ["status", "next_attempt_at"])
    with op.batch_alter_table("jobs") as batch:   # batch: SQLite cannot add a foreign key in place
        batch.add_column(sa.Column("webhook_endpoint_id", sa.String(), nullable=True))
        batch.create_foreign_key("fk_jobs_webhook_endpoint_id_webhook_endpoints", "webhook_endpoints",
                                 ["webhook_endpoint_id"], ["id"])
        batch.create_index("ix_jobs_finished_at", ["finished_at"])


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_index("ix_jobs_finished_at")
        batch.drop_constraint("fk_jobs_webhook_endpoint_id_webhook_endpoints", type_="foreignkey")
        batch.drop_column("webhook_endpoint_id")
    op.drop_index("ix_webhook_deliveries_status_next", table_name="webhook_deliveries")
    op.drop_index("ix_webhook_deliveries_job_id", table_name="webhook_deliveries")
    op.drop_table("webhook_deliveries")
    op.drop_index("ix_webhook_endpoints_api_key_id", table_name="webhook_endpoints")
    op.drop_table("webhook_endpoints")
