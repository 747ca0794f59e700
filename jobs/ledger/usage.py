"""Energy, device time and cost on the ledger: what a shard's attempt was charged, and a job's sums.

The worker measures its shard's charge (workers.energy) just before it commits the shard, and
the commit writes it: ledger.commit_shard sets the USAGE_COLUMNS in the same fenced update (by
attempt) that commits the shard, so whoever sees the shard committed sees its charge, and an
attempt that lost its lease records nothing. A claim clears whatever an earlier attempt recorded
(shard_leases.claim_shard: only a worker of an earlier version, which wrote the charge in a
transaction of its own before its commit, could leave one on a shard it never committed). A
job's figures are the sums over its committed shards that were charged (those that ran in a
worker or `pipeline run`; a shard the reaper gave up, or one answered at submit, ran nowhere and
has none): joules only when every one of them was measured, cost only when every one had a rate,
so a sum is never part of the truth.
"""
from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from jobs.ledger.models import Shard, ShardStatus

USAGE_COLUMNS = ("joules", "device_seconds", "cost", "energy_meter", "energy_unmeasured")
NOT_RUN = "no shard of it ran on a device: answered from stored answers, or never run"


def job_usage(s: Session, job_id: str) -> dict:
    """The job's joules, device_seconds, cost and energy_unmeasured (why joules is null), over
    its committed shards so far (the whole job once it ended)."""
    rows = s.execute(select(Shard.index, Shard.joules, Shard.device_seconds, Shard.cost, Shard.energy_unmeasured)
                     .where(Shard.job_id == job_id, Shard.status.in_(ShardStatus.terminal()),
                            Shard.device_seconds.is_not(None))
                     .order_by(Shard.index)).all()
    s.commit()
    if not rows:
        return {"joules": None, "device_seconds": None, "cost": None, "energy_unmeasured": NOT_RUN}
    unmeasured = [row for row in rows if row.joules is None]
    why = None
    if unmeasured:
        first = unmeasured[0].energy_unmeasured or "no energy counter"
        why = first if len(unmeasured) == len(rows) else \
            f"{len(unmeasured)} of {len(rows)} shards not measured (shard {unmeasured[0].index}: {first})"
    return {"joules": None if unmeasured else sum(row.joules for row in rows),
            "device_seconds": sum(row.device_seconds for row in rows),
            "cost": None if any(row.cost is None for row in rows) else sum(row.cost for row in rows),
            "energy_unmeasured": why}
