"""Stored answers scoped to their owner: each job's answer scope, and a key's shared one.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-04

A request's key now includes its job's answer scope (jobs.reuse.answer_key), so an answer is
reused only within it: the local scope of CLI jobs (null), one API key's own scope, or a
scope several keys share by choice (`pipeline keys add NAME --share-answers SCOPE`).
The index entries of earlier API jobs were keyed without a scope, as a CLI job's are: they
are removed, so no other key or CLI job can take those answers (their results stay).
"""
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: Union[str, Sequence[str], None] = "0012"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:   # batch: SQLite cannot alter in place
        batch.add_column(sa.Column("answer_scope", sa.String(), nullable=True))
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("answer_scope", sa.String(), nullable=True))
    op.execute("UPDATE jobs SET answer_scope = 'key:' || api_key_id WHERE api_key_id IS NOT NULL")
    op.execute("DELETE FROM answers WHERE job_id IN (SELECT id FROM jobs WHERE api_key_id IS NOT NULL)")


def downgrade() -> None:
    op.execute("DELETE FROM answers WHERE job_id IN (SELECT id FROM jobs WHERE answer_scope IS NOT NULL)")
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("answer_scope")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("answer_scope")
