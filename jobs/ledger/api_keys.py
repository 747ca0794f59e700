"""The HTTP API's keys: made, listed, revoked, and the key of a request found.

A key is 32 random bytes (`sk-pipeline-` + URL-safe text), shown once when it is made; the
ledger keeps only its SHA-256 (a random key needs no slow hash: there is nothing to guess
from). A request's key is compared with every live key's hash in constant time, so how long
the look-up takes says nothing about which hashes exist.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from jobs.ledger.models import ApiKey, utcnow

KEY_PREFIX = "sk-pipeline-"


class KeyNameTaken(ValueError):
    """A key (live or revoked) already has that name."""


def key_sha256(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def add_key(s: Session, name: str, share_answers: str | None = None) -> tuple[ApiKey, str]:
    """A new key named `name`: (its row, the key itself, which is never stored). share_answers:
    a scope name whose keys reuse one another's stored answers (None: only its own)."""
    if not name or not name.strip():
        raise ValueError("a key needs a name (e.g. the team that uses it)")
    if share_answers is not None and not share_answers.strip():
        raise ValueError("a shared answer scope needs a name (e.g. the team whose keys share it)")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    row = ApiKey(id="key_" + secrets.token_hex(8), name=name, key_sha256=key_sha256(key),
                 answer_scope=None if share_answers is None else f"shared:{share_answers.strip()}")
    s.add(row)
    try:
        s.commit()
    except IntegrityError:
        s.rollback()
        raise KeyNameTaken(f"a key named {name!r} exists already (revoked keys keep their names); "
                           "choose another name") from None
    return row, key


def answer_scope(s: Session, key_id: str) -> str:
    """The scope a key's jobs store and reuse answers in: its own ("key:<id>") unless it was
    made to share one. A scope never leaks into another: a request's key includes it."""
    shared = s.scalar(select(ApiKey.answer_scope).where(ApiKey.id == key_id))
    s.commit()
    return shared or f"key:{key_id}"


def list_keys(s: Session) -> list[ApiKey]:
    """Every key, live and revoked, oldest first."""
    keys = list(s.scalars(select(ApiKey).order_by(ApiKey.created_at, ApiKey.id)
                          .execution_options(populate_existing=True)))
    s.commit()
    return keys


def revoke_key(s: Session, name_or_id: str) -> ApiKey | None:
    """Revoke the live key with that name or id; None if there is none."""
    won = s.execute(update(ApiKey)
                    .where((ApiKey.name == name_or_id) | (ApiKey.id == name_or_id), ApiKey.revoked_at.is_(None))
                    .values(revoked_at=utcnow()), execution_options={"synchronize_session": False}).rowcount
    s.commit()
    if not won:
        return None
    key = s.scalar(select(ApiKey).where((ApiKey.name == name_or_id) | (ApiKey.id == name_or_id))
                   .execution_options(populate_existing=True))
    s.commit()
    return key


def find_key(s: Session, key: str) -> ApiKey | None:
    """The live key whose hash is key's, compared with every live key in constant time."""
    wanted = key_sha256(key).encode()
    live = list(s.scalars(select(ApiKey).where(ApiKey.revoked_at.is_(None))))
    s.commit()
    found = None
    for row in live:   # no early exit: every hash is compared
        if hmac.compare_digest(row.key_sha256.encode(), wanted):
            found = row
    return found
