"""Energy and cost: what each shard's committed attempt was charged, and the job's sums.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-07

`shards.joules` (from the device's energy counter: NVML on a GPU, RAPL on a CPU; null where
none was readable, `shards.energy_unmeasured` saying why, `shards.energy_meter` naming the
counter), `shards.device_seconds` and `shards.cost` (device-seconds at the worker's
`--cost-per-hour`; null: no rate) are set by the worker before it commits a shard
(workers.energy). The job's `joules`, `tokens_per_joule`, `device_seconds`, `cost` and
`energy_unmeasured` are their sums, set when it ends. Every job and shard before this one
has them null: nothing was measured.
"""
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: Union[str, Sequence[str], None] = "0015"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

_SHARD_COLUMNS = (("joules", sa.Float), ("device_seconds", sa.Float), ("cost", sa.Float),
                  ("energy_meter", sa.String), ("energy_unmeasured", sa.Text))
_JOB_COLUMNS = (("joules", sa.Float), ("tokens_per_joule", sa.Float), ("device_seconds", sa.Float),
                ("cost", sa.Float), ("energy_unmeasured", sa.Text))


def upgrade() -> None:
    with op.batch_alter_table("shards") as batch:
        for name, type_ in _SHARD_COLUMNS:
            batch.add_column(sa.Column(name, type_(), nullable=True))
    with op.batch_alter_table("jobs") as batch:
        for name, type_ in _JOB_COLUMNS:
            batch.add_column(sa.Column(name, type_(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        for name, _ in reversed(_JOB_COLUMNS):
            batch.drop_column(name)
    with op.batch_alter_table("shards") as batch:
        for name, _ in reversed(_SHARD_COLUMNS):
            batch.drop_column(name)
