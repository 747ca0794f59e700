"""The webhook sender: records the events of jobs that ended, and posts the due ones.

A pass (send_due) first makes the pending delivery of every job that ended lately with an
endpoint (jobs.ledger.record_events), then posts each due delivery it claims
(jobs.ledger.claim_delivery: one sender per attempt, however many workers sweep at once),
signed as Standard Webhooks and OpenAI sign them (jobs.webhooks). A 2xx settles it for
good; anything else (an HTTP error, a refused connection, a timeout, a redirect: never
followed) is retried after PIPELINE_WEBHOOK_BACKOFF_SECONDS, twice as long each time (at most
an hour), until a day after its event, and is then failed. Every attempt is in the ledger.

Nothing here runs when a job ends, so a slow or dead receiver never holds a job up: every
worker runs a pass each PIPELINE_RECOVERY_INTERVAL seconds in a thread of its own (beside
its recovery thread, which a receiver's timeout must not delay either; both are
workers.periodic threads, started by workers.recovery.start_thread), and `pipeline
recover` runs one after its recovery pass.
"""
from __future__ import annotations

import logging
import time
import urllib.error
import urllib.request
from datetime import timedelta

from sqlalchemy.orm import Session, sessionmaker

from jobs import ledger
from jobs.webhooks import RETRY_FOR_S, headers, retry_delay

log = logging.getLogger(__name__)

TIMEOUT_S = 10.0                 # a receiver has this long to connect and to answer each read
LEASE_S = 6 * TIMEOUT_S          # a claimed delivery is another sender's again after this long
BATCH = 100                      # deliveries taken per pass (the rest: next pass)


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A 3xx is a failed attempt: a signed event is posted only where it was configured to go."""

    def redirect_request(self, *args, **kwargs):
        return None


_opener = urllib.request.build_opener(_NoRedirects)


def post(url: str, body: str, head: dict[str, str], timeout_s: float = TIMEOUT_S) -> str | None:
    """POST body to url; None after a 2xx, else what went wrong (for the ledger's last_error)."""
    request = urllib.request.Request(url, data=body.encode(), headers=head, method="POST")
    try:
        with _opener.open(request, timeout=timeout_s) as response:
            response.read(1024)
            return None if 200 <= response.status < 300 else f"HTTP {response.status}"
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code} {e.reason}".strip()
    except (urllib.error.URLError, OSError, ValueError) as e:   # refused, unreachable, timed out, bad URL
        reason = getattr(e, "reason", None) or e
        return f"{type(reason).__name__}: {reason}"


def send_due(Session: sessionmaker[Session], backoff_s: float, *, limit: int = BATCH) -> dict:
    """One pass: record new events, post the due deliveries this sender claims. Returns
    {"recorded", "delivered", "retrying", "failed"}: delivery ids."""
    report: dict = {"recorded": [], "delivered": [], "retrying": [], "failed": []}
    with Session() as s:
        report["recorded"] = ledger.record_events(s)
        due = ledger.due_deliveries(s, limit=limit)
    for delivery_id in due:
        with Session() as s:
            claimed = ledger.claim_delivery(s, delivery_id, LEASE_S)
        if claimed is None:   # another sender has it, or settled it meanwhile
            continue
        outcome = _attempt(Session, claimed, backoff_s)
        if outcome:
            report[outcome].append(delivery_id)
    return report


def _attempt(Session, claimed: ledger.Claimed, backoff_s: float) -> str | None:
    """Post one claimed attempt and settle it; which list of the report it goes in (None: the
    claim had lapsed and another sender settles it)."""
    body = claimed.payload
    error = post(claimed.url, body, headers(claimed.secret, claimed.id, int(time.time()), body))
    with Session() as s:
        if error is None:
            return "delivered" if ledger.mark_delivered(s, claimed.id, claimed.attempt) else None
        now = ledger.utcnow()
        retry_at = now + timedelta(seconds=retry_delay(claimed.attempt, backoff_s))
        give_up = retry_at > claimed.created_at + timedelta(seconds=RETRY_FOR_S)
        log.log(logging.WARNING if give_up else logging.INFO, "webhook %s to %s: attempt %d failed: %s%s",
                claimed.id, claimed.url, claimed.attempt, error, "; given up" if give_up else "")
        if not ledger.mark_failed_attempt(s, claimed.id, claimed.attempt, error, None if give_up else retry_at):
            return None
    return "failed" if give_up else "retrying"


def log_pass(Session: sessionmaker[Session], backoff_s: float) -> None:
    """One pass, what it did logged (a worker's webhook thread: workers.periodic)."""
    report = send_due(Session, backoff_s)
    if any(report.values()):
        log.info("webhooks: %s", {k: v for k, v in report.items() if v})
