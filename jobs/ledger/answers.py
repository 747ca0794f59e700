"""The index of stored answers (jobs.reuse.stored_answers): written with a shard's commit, looked up by a
later job's shards, removed with a job's results (`pipeline gc`)."""
from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import delete, insert, select
from sqlalchemy.orm import Session

from jobs.ledger.models import Answer, Job, utcnow

_LOOKUP_CHUNK = 500   # keys per IN (...): well under every database's parameter limit


def add_answers(s: Session, job_id: str, shard: int, answers: Iterable[tuple[str, str]]) -> None:
    """Index (key, request id) answers of a shard, in the caller's transaction (commit_shard's)."""
    now = utcnow()
    rows = [{"job_id": job_id, "request_id": rid, "key": key, "shard": shard, "created_at": now} for key, rid in answers]
    if rows:   # a Core insert of the table: the ORM's bulk path costs a third more per row
        s.execute(insert(Answer.__table__), rows)


def find_answers(s: Session, keys: Iterable[str], *, exclude_job: str) -> dict[str, list[tuple[str, int, str]]]:
    """For each key with stored answers in other jobs: (job id, shard, request id), newest first."""
    keys = list(dict.fromkeys(keys))
    found: dict[str, list[tuple[str, int, str]]] = {}
    for at in range(0, len(keys), _LOOKUP_CHUNK):
        rows = s.execute(select(Answer.key, Answer.job_id, Answer.shard, Answer.request_id)
                         .where(Answer.key.in_(keys[at:at + _LOOKUP_CHUNK]), Answer.job_id != exclude_job)
                         .order_by(Answer.created_at.desc())).all()
        for key, job_id, shard, rid in rows:
            found.setdefault(key, []).append((job_id, shard, rid))
    s.commit()
    return found


def any_answers_of(s: Session, engine_fingerprint: str, answer_scope: str | None) -> bool:
    """Whether any job of this engine fingerprint and answer scope has stored answers (a first
    night has none: the submit then skips its lookup)."""
    scope = Job.answer_scope.is_(None) if answer_scope is None else Job.answer_scope == answer_scope
    found = s.execute(select(Answer.key).join(Job, Job.id == Answer.job_id)
                      .where(Job.engine_fingerprint == engine_fingerprint, scope).limit(1)).first()
    s.commit()
    return found is not None


def delete_answers(s: Session, job_ids: Iterable[str]) -> int:
    """Forget the stored answers of these jobs (before their results are deleted); how many."""
    job_ids = list(job_ids)
    if not job_ids:
        return 0
    n = s.execute(delete(Answer).where(Answer.job_id.in_(job_ids))).rowcount
    s.commit()
    return n
