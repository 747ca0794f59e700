"""The one way the ledger changes state: a conditional UPDATE whose rowcount says who won."""
from __future__ import annotations

from sqlalchemy import and_
from sqlalchemy.orm import Session

from jobs.ledger.models import Shard, ShardStatus


def held(job_id: str, index: int, attempt: int):
    """The shard is running under exactly this attempt."""
    return and_(Shard.job_id == job_id, Shard.index == index,
                Shard.status == ShardStatus.RUNNING, Shard.attempt == attempt)


def execute(s: Session, stmt):
    # Bulk UPDATEs: the ledger re-reads rows (populate_existing) instead of syncing the session.
    return s.execute(stmt, execution_options={"synchronize_session": False})


def commit_if_won(s: Session, stmt) -> bool:
    won = execute(s, stmt).rowcount == 1
    if won:
        s.commit()
    else:
        s.rollback()
    return won
