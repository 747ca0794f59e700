"""Webhook endpoints and deliveries in the ledger: set, recorded, claimed, settled.

A job's end is never held up by its webhook: nothing here runs when a job ends. A sender
(workers.webhook_sender) first records the events of the jobs that ended lately and have an
endpoint (record_events: one delivery row per job, event type and endpoint, made once
however many senders race, by INSERT ... ON CONFLICT DO NOTHING on that unique key), then
posts the due ones. A sender claims a delivery before posting it with a conditional UPDATE
that takes the next attempt number (the fencing token, as a shard's attempt is) and holds
it for a lease; only that attempt may settle it: delivered after a 2xx (never sent again),
else pending until its next attempt, or failed once a day has passed. A sender that dies
mid-post leaves it to be claimed again when the lease lapses.
"""
from __future__ import annotations

import secrets
from datetime import datetime, timedelta
from enum import Enum
from typing import NamedTuple

from sqlalchemy import and_, exists, or_, select, union_all, update
from sqlalchemy.orm import Session

from jobs.ledger.conditional import commit_if_won
from jobs.ledger.models import ApiKey, Job, WebhookDelivery, WebhookEndpoint, utcnow
from jobs.webhooks import EVENT_TYPES, RETRY_FOR_S, event_body, new_secret


class DeliveryStatus(str, Enum):
    """pending -> sending (claimed) -> delivered | pending (to retry) | failed (a day passed)."""

    def __str__(self) -> str:
        return self.value

    PENDING = "pending"
    SENDING = "sending"
    DELIVERED = "delivered"
    FAILED = "failed"


class Claimed(NamedTuple):
    """What a sender needs to post one attempt of a delivery it claimed."""
    id: str
    attempt: int
    url: str
    secret: str
    payload: str
    created_at: datetime


# --- endpoints ---------------------------------------------------------------------------------

def set_key_endpoint(s: Session, name_or_id: str, url: str) -> tuple[ApiKey, WebhookEndpoint] | None:
    """Give the live key named (or with id) name_or_id a new endpoint with a fresh secret,
    replacing its previous one (whose pending deliveries still go where they were bound);
    None if there is no such key."""
    key = _live_key(s, name_or_id)
    if key is None:
        return None
    now = utcnow()
    _disable(s, WebhookEndpoint.api_key_id == key.id, now)
    endpoint = WebhookEndpoint(id=_new_id("we_"), url=url, secret=new_secret(), api_key_id=key.id, created_at=now)
    s.add(endpoint)
    s.commit()
    return key, endpoint


def remove_key_endpoint(s: Session, name_or_id: str) -> ApiKey | None:
    """The live key's endpoint off (its batches end without an event); None: no such key."""
    key = _live_key(s, name_or_id)
    if key is not None:
        _disable(s, WebhookEndpoint.api_key_id == key.id, utcnow())
        s.commit()
    return key


def key_endpoints(s: Session) -> dict[str, WebhookEndpoint]:
    """Each key's live endpoint, by key id."""
    rows = s.scalars(select(WebhookEndpoint).where(WebhookEndpoint.api_key_id.is_not(None),
                                                   WebhookEndpoint.disabled_at.is_(None))
                     .order_by(WebhookEndpoint.created_at))
    found = {row.api_key_id: row for row in rows}
    s.commit()
    return found


def cli_endpoint(s: Session, url: str, secret: str | None) -> tuple[WebhookEndpoint, bool]:
    """The endpoint CLI jobs notifying url share, and whether it was made now (its secret is
    then new: shown once). Without a secret, the live one for url is reused (one secret per
    receiver, night after night); a secret other than its own replaces it."""
    live = s.scalar(select(WebhookEndpoint)
                    .where(WebhookEndpoint.api_key_id.is_(None), WebhookEndpoint.url == url,
                           WebhookEndpoint.disabled_at.is_(None))
                    .order_by(WebhookEndpoint.created_at.desc()).limit(1))
    if live is not None and secret in (None, live.secret):
        s.commit()
        return live, False
    now = utcnow()
    _disable(s, and_(WebhookEndpoint.api_key_id.is_(None), WebhookEndpoint.url == url), now)
    endpoint = WebhookEndpoint(id=_new_id("we_"), url=url, secret=secret or new_secret(), created_at=now)
    s.add(endpoint)
    s.commit()
    return endpoint, True


def notify(s: Session, job_id: str, endpoint_id: str) -> None:
    """Post job_id's end to the endpoint (a CLI job's --notify)."""
    s.execute(update(Job).where(Job.id == job_id).values(webhook_endpoint_id=endpoint_id),
              execution_options={"synchronize_session": False})
    s.commit()


def endpoint_of(s: Session, job: Job) -> WebhookEndpoint | None:
    """The endpoint the job's end will be posted to, as of now (None: none)."""
    if job.webhook_endpoint_id is not None:
        found = s.get(WebhookEndpoint, job.webhook_endpoint_id)
    elif job.api_key_id is not None:
        found = key_endpoints(s).get(job.api_key_id)
    else:
        found = None
    s.commit()
    return found


def _live_key(s: Session, name_or_id: str) -> ApiKey | None:
    return s.scalar(select(ApiKey).where(or_(ApiKey.name == name_or_id, ApiKey.id == name_or_id),
                                         ApiKey.revoked_at.is_(None)))


def _disable(s: Session, which, now: datetime) -> None:
    s.execute(update(WebhookEndpoint).where(which, WebhookEndpoint.disabled_at.is_(None)).values(disabled_at=now),
              execution_options={"synchronize_session": False})


def _new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(16)


# --- deliveries --------------------------------------------------------------------------------

def record_events(s: Session, now: datetime | None = None, window_s: float = RETRY_FOR_S) -> list[str]:
    """Make the pending delivery of every job that ended in the last window_s seconds with an
    endpoint (its own --notify one; or its key's, the one live when it ended) and has none
    yet; returns the ids of those this call made. Safe when senders race: a (job, type,
    endpoint) gets one row, so one event id, whoever wins."""
    now = now or utcnow()
    ended = (Job.status.in_(tuple(EVENT_TYPES)), Job.finished_at >= now - timedelta(seconds=window_s),
             ~exists().where(WebhookDelivery.job_id == Job.id, WebhookDelivery.endpoint_id == WebhookEndpoint.id))
    columns = (Job.id, Job.status, Job.finished_at, WebhookEndpoint.id.label("endpoint_id"))
    own = select(*columns).join(WebhookEndpoint, WebhookEndpoint.id == Job.webhook_endpoint_id).where(*ended)
    keys = (select(*columns)
            .join(WebhookEndpoint, and_(WebhookEndpoint.api_key_id == Job.api_key_id,
                                        WebhookEndpoint.created_at <= Job.finished_at,
                                        or_(WebhookEndpoint.disabled_at.is_(None),
                                            WebhookEndpoint.disabled_at > Job.finished_at)))
            .where(*ended))
    made = []
    for job_id, status, finished_at, endpoint_id in s.execute(union_all(own, keys)).all():
        event_id, event_type = _new_id("evt_"), EVENT_TYPES[status]
        row = dict(id=event_id, job_id=job_id, type=event_type, endpoint_id=endpoint_id,
                   payload=event_body(event_id, event_type, job_id, finished_at),
                   status=DeliveryStatus.PENDING, attempts=0, next_attempt_at=now, created_at=now)
        if s.execute(_insert_once(s, row)).scalar() is not None:   # RETURNING: no row when it existed
            made.append(event_id)
    s.commit()
    return made


def _insert_once(s: Session, row: dict):
    """INSERT that does nothing when the (job, type, endpoint) row exists already."""
    if s.get_bind().dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    return insert(WebhookDelivery).values(**row).on_conflict_do_nothing(
        index_elements=["job_id", "type", "endpoint_id"]).returning(WebhookDelivery.id)


def due_deliveries(s: Session, now: datetime | None = None, limit: int = 100) -> list[str]:
    """Deliveries whose next attempt is due (or whose sender's claim lapsed), oldest first."""
    ids = list(s.scalars(select(WebhookDelivery.id)
                         .where(WebhookDelivery.status.in_((DeliveryStatus.PENDING, DeliveryStatus.SENDING)),
                                WebhookDelivery.next_attempt_at <= (now or utcnow()))
                         .order_by(WebhookDelivery.next_attempt_at).limit(limit)))
    s.commit()
    return ids


def claim_delivery(s: Session, delivery_id: str, lease_s: float, now: datetime | None = None) -> Claimed | None:
    """Take the next attempt of a due delivery for lease_s seconds; None if another sender
    has it, or it is not due, or it is settled."""
    now = now or utcnow()
    stmt = (update(WebhookDelivery)
            .where(WebhookDelivery.id == delivery_id,
                   WebhookDelivery.status.in_((DeliveryStatus.PENDING, DeliveryStatus.SENDING)),
                   WebhookDelivery.next_attempt_at <= now)
            .values(status=DeliveryStatus.SENDING, attempts=WebhookDelivery.attempts + 1,
                    next_attempt_at=now + timedelta(seconds=lease_s))
            .returning(WebhookDelivery.attempts))
    attempt = s.execute(stmt, execution_options={"synchronize_session": False}).scalar()
    if attempt is None:
        s.rollback()
        return None
    row = s.execute(select(WebhookEndpoint.url, WebhookEndpoint.secret, WebhookDelivery.payload,
                           WebhookDelivery.created_at)
                    .join(WebhookEndpoint, WebhookEndpoint.id == WebhookDelivery.endpoint_id)
                    .where(WebhookDelivery.id == delivery_id)).one()
    s.commit()
    return Claimed(delivery_id, attempt, *row)


def _held(delivery_id: str, attempt: int):
    return and_(WebhookDelivery.id == delivery_id, WebhookDelivery.status == DeliveryStatus.SENDING,
                WebhookDelivery.attempts == attempt)


def mark_delivered(s: Session, delivery_id: str, attempt: int, now: datetime | None = None) -> bool:
    """The receiver answered 2xx to this attempt: never sent again. False if the attempt no
    longer held it (its lease lapsed and another took it)."""
    return commit_if_won(s, update(WebhookDelivery).where(_held(delivery_id, attempt))
                         .values(status=DeliveryStatus.DELIVERED, delivered_at=now or utcnow()))


def mark_failed_attempt(s: Session, delivery_id: str, attempt: int, error: str, retry_at: datetime | None) -> bool:
    """This attempt failed with error: pending again until retry_at, or failed for good (None)."""
    values = (dict(status=DeliveryStatus.PENDING, next_attempt_at=retry_at) if retry_at is not None
              else dict(status=DeliveryStatus.FAILED))
    return commit_if_won(s, update(WebhookDelivery).where(_held(delivery_id, attempt))
                         .values(last_error=error[:2000], **values))


def deliveries_of_job(s: Session, job_id: str) -> list[tuple[WebhookDelivery, str]]:
    """The job's deliveries with their endpoints' URLs, oldest first."""
    rows = [(d, url) for d, url in s.execute(
        select(WebhookDelivery, WebhookEndpoint.url)
        .join(WebhookEndpoint, WebhookEndpoint.id == WebhookDelivery.endpoint_id)
        .where(WebhookDelivery.job_id == job_id).order_by(WebhookDelivery.created_at)
        .execution_options(populate_existing=True)).all()]
    s.commit()
    return rows
