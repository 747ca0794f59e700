"""Mixed-model jobs: a job may name several models, each shard runs one of them.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-08

`jobs.models` lists a job's models (the --model given, in order) when it has several; null for
a one-model job, whose rows stay as before. A shard of a several-model job holds the lines of
one model: `shards.engine_key` routes it to that engine's queue, and `shards.engine_options` and
`shards.engine_fingerprint` are what a worker builds the engine from and keys its answers with.
Null (every shard of a one-model job, every shard before this one) means the job's own.
"""
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: Union[str, Sequence[str], None] = "0016"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

_SHARD_COLUMNS = (("engine_key", sa.String), ("engine_options", sa.JSON), ("engine_fingerprint", sa.String))


def upgrade() -> None:
    with op.batch_alter_table("shards") as batch:
        for name, type_ in _SHARD_COLUMNS:
            batch.add_column(sa.Column(name, type_(), nullable=True))
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("models", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("models")
    with op.batch_alter_table("shards") as batch:
        for name, _ in reversed(_SHARD_COLUMNS):
            batch.drop_column(name)
