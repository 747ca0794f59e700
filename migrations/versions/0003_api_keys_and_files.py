"""The HTTP API (`pipeline serve`): its keys, its files, and the key that owns each job.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01

Existing jobs were made by the CLI: they get no key (api_key_id null).
"""
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: Union[str, Sequence[str], None] = "0002"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("key_sha256", sa.String(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_api_keys"),
        sa.UniqueConstraint("name", name="uq_api_keys_name"),
        sa.UniqueConstraint("key_sha256", name="uq_api_keys_key_sha256"),
    )
    op.create_table(
        "files",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("api_key_id", sa.String(), nullable=True),
        sa.Column("purpose", sa.String(), nullable=False),
        sa.Column("filename", sa.String(), nullable=False),
        sa.Column("bytes", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("job_id", sa.String(), nullable=True),
        sa.ForeignKeyConstraint(["api_key_id"], ["api_keys.id"], name="fk_files_api_key_id_api_keys"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name="fk_files_job_id_jobs", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_files"),
    )
    op.create_index("ix_files_api_key_id", "files", ["api_key_id"])
    op.create_index("ix_files_job_id", "files", ["job_id"])
    with op.batch_alter_table("jobs") as batch:   # batch: SQLite cannot add a foreign key in place
        batch.add_column(sa.Column("api_key_id", sa.String(), nullable=True))
        batch.create_foreign_key("fk_jobs_api_key_id_api_keys", "api_keys", ["api_key_id"], ["id"])
        batch.create_index("ix_jobs_api_key_id", ["api_key_id"])


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_index("ix_jobs_api_key_id")
        batch.drop_constraint("fk_jobs_api_key_id_api_keys", type_="foreignkey")
        batch.drop_column("api_key_id")
    op.drop_index("ix_files_job_id", table_name="files")
    op.drop_index("ix_files_api_key_id", table_name="files")
    op.drop_table("files")
    op.drop_table("api_keys")
