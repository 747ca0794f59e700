"""The rows of the HTTP API's files (the bytes live under the data root: jobs.paths.file_path)."""
from __future__ import annotations

from sqlalchemy import or_, select, tuple_, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from jobs.ledger.models import File, utcnow


def add_file(s: Session, **columns) -> File | None:
    """Insert a file row; None if a row with that id exists (a batch's output files are made
    by whichever request sees the batch ended first: the others find the row there)."""
    row = File(**columns)
    s.add(row)
    try:
        s.commit()
    except IntegrityError:
        s.rollback()
        return None
    return row


def get_file(s: Session, file_id: str) -> File | None:
    """The file with that id; None if there is none, it was deleted or it expired (its
    expires_at passed, even before the recovery sweep deleted it)."""
    row = s.get(File, file_id, populate_existing=True)
    s.commit()
    return None if row is None or row.deleted_at is not None or file_expired(row) else row


def file_expired(row: File, now=None) -> bool:
    """Whether the file's expires_at has passed."""
    return row.expires_at is not None and row.expires_at <= (now or utcnow())


def expired_files(s: Session, now=None) -> list[str]:
    """The ids of the files past their expires_at that are not deleted yet."""
    ids = list(s.scalars(select(File.id).where(File.deleted_at.is_(None), File.expires_at.is_not(None),
                                               File.expires_at <= (now or utcnow()))))
    s.commit()
    return ids


def files_of_job(s: Session, job_id: str) -> list[File]:
    """A batch's output and error files (none until they are written; deleted ones too,
    marked deleted_at)."""
    rows = list(s.scalars(select(File).where(File.job_id == job_id).execution_options(populate_existing=True)))
    s.commit()
    return rows


def list_files(s: Session, api_key_id: str | None, *, purpose: str | None = None, after: File | None = None,
               limit: int = 100, newest_first: bool = True) -> list[File]:
    """A key's files, newest first (or oldest), those after `after` in that order only."""
    order = (File.created_at.desc(), File.id.desc()) if newest_first else (File.created_at, File.id)
    stmt = select(File).where(File.api_key_id == api_key_id, File.deleted_at.is_(None),
                              or_(File.expires_at.is_(None), File.expires_at > utcnow()))
    if purpose:
        stmt = stmt.where(File.purpose == purpose)
    if after is not None:
        cursor, at = tuple_(File.created_at, File.id), (after.created_at, after.id)
        stmt = stmt.where(cursor < at if newest_first else cursor > at)
    rows = list(s.scalars(stmt.order_by(*order).limit(limit).execution_options(populate_existing=True)))
    s.commit()
    return rows


def delete_file(s: Session, file_id: str) -> bool:
    """Mark the file deleted (its row stays, so a batch's output is never written again)."""
    won = s.execute(update(File).where(File.id == file_id, File.deleted_at.is_(None))
                    .values(deleted_at=utcnow())).rowcount == 1
    s.commit()
    return won
