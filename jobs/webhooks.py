"""Webhooks in the Standard Webhooks format that OpenAI's use: secrets, event bodies,
signatures, and the retry schedule. No HTTP and no SQL here (workers.webhook_sender posts,
jobs.ledger.webhooks records).

A delivery is a POST of the event's JSON body with three headers: `webhook-id` (the event
id, the same on every retry, so a receiver can drop a duplicate), `webhook-timestamp` (Unix
seconds of this attempt: verifiers refuse one more than 5 minutes off) and
`webhook-signature` (`v1,` + base64 HMAC-SHA256 of "{id}.{timestamp}.{body}" keyed with the
secret's bytes). A secret is `whsec_` + base64 of 24 to 64 random bytes.
The signing is the spec's ten lines of hmac rather than the `standardwebhooks` package:
its older releases pull in httpx, attrs and dateutil for a client we do not need.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import random
import secrets
from datetime import datetime
from urllib.parse import urlsplit

SECRET_PREFIX = "whsec_"
SECRET_BYTES = 32
# The event of each job status that ends it (OpenAI's batch events; CLI jobs send the same).
# Plain words, as the ledger stores them: this module imports nothing of the ledger.
EVENT_TYPES = {"completed": "batch.completed", "failed": "batch.failed", "expired": "batch.expired",
               "cancelled": "batch.cancelled"}
RETRY_FOR_S = 86400.0     # a delivery is retried for a day after its event, then given up
MAX_DELAY_S = 3600.0      # no wait between two attempts is longer than an hour


def new_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def secret_key(secret: str) -> bytes:
    """The key bytes of a `whsec_...` secret; ValueError unless it is one (24 to 64 bytes, as
    the Standard Webhooks spec sizes them)."""
    if not secret.startswith(SECRET_PREFIX):
        raise ValueError(f"a webhook secret starts with {SECRET_PREFIX} (then base64)")
    try:
        key = base64.b64decode(secret[len(SECRET_PREFIX):], validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("a webhook secret is whsec_ and then base64") from None
    if not 24 <= len(key) <= 64:
        raise ValueError(f"a webhook secret holds 24 to 64 bytes, this one {len(key)}")
    return key


def check_url(url: str) -> str:
    """An http(s) URL with a host, or ValueError."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"a webhook URL is http:// or https:// with a host, not {url!r}")
    return url


def event_body(event_id: str, event_type: str, job_id: str, ended_at: datetime) -> str:
    """An OpenAI webhook event as JSON: its created_at is when the job ended (OpenAI's "when
    the batch API request was completed"), data.id the batch (the job)."""
    return json.dumps({"id": event_id, "object": "event", "created_at": int(ended_at.timestamp()),
                       "type": event_type, "data": {"id": job_id}}, separators=(",", ":"))


def sign(secret: str, event_id: str, timestamp: int, body: str | bytes) -> str:
    """The webhook-signature header's value."""
    raw = body.encode() if isinstance(body, str) else body
    mac = hmac.new(secret_key(secret), f"{event_id}.{timestamp}.".encode() + raw, hashlib.sha256)
    return "v1," + base64.b64encode(mac.digest()).decode()


def headers(secret: str, event_id: str, timestamp: int, body: str) -> dict[str, str]:
    return {"webhook-id": event_id, "webhook-timestamp": str(timestamp),
            "webhook-signature": sign(secret, event_id, timestamp, body),
            "content-type": "application/json", "user-agent": "batch-pipeline-webhooks/1"}


def retry_delay(attempts: int, base_s: float) -> float:
    """Seconds to wait after the attempts-th failed attempt: base, then twice as long each
    time (at most MAX_DELAY_S), plus up to 10% so that senders do not retry in step."""
    delay = min(base_s * 2.0 ** max(attempts - 1, 0), max(MAX_DELAY_S, base_s))
    return delay * (1 + 0.1 * random.random())
