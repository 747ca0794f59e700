"""Webhook deliveries in the ledger (jobs.ledger.webhooks) and the sender's passes
(workers.webhook_sender), on real SQLite and PostgreSQL, against a real HTTP receiver: one
event per job and endpoint however many senders race, claims fenced by the attempt, retries
with backoff, never a delivery again after a 2xx, and given up after a day."""
from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from sqlalchemy import update

from jobs import ledger
from jobs.ledger import Job, WebhookDelivery, utcnow
from jobs.webhooks import new_secret
from ledger_helpers import make_job
from webhook_receiver import Receiver
from workers.webhook_sender import LEASE_S, send_due


def end(Session, job_id: str, status: str = "completed", ago_s: float = 0.0, key_id: str | None = None) -> None:
    with Session() as s:
        s.execute(update(Job).where(Job.id == job_id).values(
            status=status, finished_at=utcnow() - timedelta(seconds=ago_s), api_key_id=key_id))
        s.commit()


def notified_job(Session, url: str, status: str = "completed", secret: str | None = None):
    job_id = make_job(Session)
    with Session() as s:
        endpoint, _ = ledger.cli_endpoint(s, url, secret)
        ledger.notify(s, job_id, endpoint.id)
    end(Session, job_id, status)
    return job_id, endpoint


def deliveries(Session, job_id: str) -> list:
    with Session() as s:
        return [d for d, _ in ledger.deliveries_of_job(s, job_id)]


def test_an_ended_job_gets_one_event_per_endpoint_however_often_it_is_recorded(Session):
    done, endpoint = notified_job(Session, "http://127.0.0.1:9/a")
    cancelled, _ = notified_job(Session, "http://127.0.0.1:9/a", status="cancelled")
    running = make_job(Session)
    with Session() as s:
        ledger.notify(s, running, endpoint.id)
        made = ledger.record_events(s)
        assert ledger.record_events(s) == []
    assert sorted(made) == sorted(d.id for job in (done, cancelled) for d in deliveries(Session, job))
    (d,) = deliveries(Session, done)
    assert (d.type, d.status, d.attempts, d.endpoint_id) == ("batch.completed", "pending", 0, endpoint.id)
    assert d.id.startswith("evt_") and f'"id":"{d.id}"' in d.payload and f'"data":{{"id":"{done}"}}' in d.payload
    assert deliveries(Session, cancelled)[0].type == "batch.cancelled" and deliveries(Session, running) == []


def test_a_cli_url_keeps_its_secret_until_another_is_given(Session):
    with Session() as s:
        first, made = ledger.cli_endpoint(s, "http://127.0.0.1:9/a", None)
        again, made_again = ledger.cli_endpoint(s, "http://127.0.0.1:9/a", None)
        other, _ = ledger.cli_endpoint(s, "http://127.0.0.1:9/b", None)
        given, made_given = ledger.cli_endpoint(s, "http://127.0.0.1:9/a", new_secret())
    assert made and not made_again and again.id == first.id and other.secret != first.secret
    assert made_given and given.id != first.id


def test_a_key_endpoint_gets_the_batches_that_end_while_it_is_live(Session):
    with Session() as s:
        key, _ = ledger.add_key(s, "team-a")
    before = make_job(Session)
    end(Session, before, ago_s=60, key_id=key.id)   # ended before the key had an endpoint
    with Session() as s:
        _, old = ledger.set_key_endpoint(s, "team-a", "http://127.0.0.1:9/old")
    during = make_job(Session)
    end(Session, during, key_id=key.id)
    with Session() as s:
        _, new = ledger.set_key_endpoint(s, key.id, "http://127.0.0.1:9/new")
        assert ledger.key_endpoints(s)[key.id].id == new.id and new.secret != old.secret
    after = make_job(Session)
    end(Session, after, key_id=key.id)
    with Session() as s:
        ledger.record_events(s)
        assert ledger.set_key_endpoint(s, "nobody", "http://127.0.0.1:9/x") is None
    assert deliveries(Session, before) == []
    assert [d.endpoint_id for d in deliveries(Session, during)] == [old.id]   # bound where it was when it ended
    assert [d.endpoint_id for d in deliveries(Session, after)] == [new.id]
    with Session() as s:
        assert ledger.remove_key_endpoint(s, "team-a").id == key.id and ledger.key_endpoints(s) == {}


def test_a_claim_is_won_once_and_only_its_attempt_settles_it(Session):
    job_id, _ = notified_job(Session, "http://127.0.0.1:9/a")
    with Session() as s:
        (delivery_id,) = ledger.record_events(s)
    with Session() as a, Session() as b:
        first = ledger.claim_delivery(a, delivery_id, LEASE_S)
        assert first.attempt == 1 and ledger.claim_delivery(b, delivery_id, LEASE_S) is None
    # the first sender stalls past its lease: the next one takes attempt 2, and the first
    # can settle nothing any more
    with Session() as s:
        late = utcnow() + timedelta(seconds=LEASE_S + 1)
        assert ledger.due_deliveries(s, late) == [delivery_id]
        second = ledger.claim_delivery(s, delivery_id, LEASE_S, now=late)
        assert second.attempt == 2
        assert not ledger.mark_delivered(s, delivery_id, first.attempt)
        assert ledger.mark_delivered(s, delivery_id, second.attempt)
        assert ledger.claim_delivery(s, delivery_id, LEASE_S, now=late + timedelta(days=2)) is None
    (d,) = deliveries(Session, job_id)
    assert (d.status, d.attempts) == ("delivered", 2) and d.delivered_at is not None


def test_senders_racing_deliver_each_event_once(Session):
    with Receiver() as receiver:
        jobs = [notified_job(Session, receiver.url("a"))[0] for _ in range(6)]
        with Session() as s:   # the URL's one endpoint
            receiver.secrets["a"] = ledger.cli_endpoint(s, receiver.url("a"), None)[0].secret
        barrier = threading.Barrier(4)
        reports = []

        def sender():
            barrier.wait()
            reports.append(send_due(Session, 1.0))

        threads = [threading.Thread(target=sender) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        events = receiver.accepted("a")
    assert sorted(e.data.id for e in events) == sorted(jobs) and len({e.id for e in events}) == len(jobs)
    assert sorted(i for r in reports for i in r["delivered"]) == sorted(e.id for e in events)
    assert sum(len(r["recorded"]) for r in reports) == len(jobs)
    assert all(d.status == "delivered" and d.attempts == 1 for job in jobs for d in deliveries(Session, job))
    assert send_due(Session, 1.0) == {"recorded": [], "delivered": [], "retrying": [], "failed": []}


def test_a_failed_attempt_is_retried_after_the_backoff_then_given_up_after_a_day(Session):
    with Receiver() as receiver:
        receiver.answer = 503
        job_id, endpoint = notified_job(Session, receiver.url("a"))
        receiver.secrets["a"] = endpoint.secret
        before = utcnow()
        assert send_due(Session, 30.0)["retrying"] == [deliveries(Session, job_id)[0].id]
        (d,) = deliveries(Session, job_id)
        assert (d.status, d.attempts, d.last_error) == ("pending", 1, "HTTP 503 Service Unavailable")
        assert before + timedelta(seconds=30) <= d.next_attempt_at <= utcnow() + timedelta(seconds=33)
        assert send_due(Session, 30.0)["retrying"] == []   # not due yet
        # a day later: the next failure gives it up
        with Session() as s:
            s.execute(update(WebhookDelivery).where(WebhookDelivery.id == d.id).values(
                next_attempt_at=utcnow(), created_at=utcnow() - timedelta(days=1)))
            s.commit()
        assert send_due(Session, 30.0)["failed"] == [d.id]
        receiver.answer = 204
        assert send_due(Session, 30.0)["delivered"] == []
    (d,) = deliveries(Session, job_id)
    assert (d.status, d.attempts) == ("failed", 2) and len(receiver.all()) == 2


def test_a_refused_connection_and_a_redirect_are_failed_attempts(Session):
    receiver = Receiver().start()
    url = receiver.url("a")
    receiver.stop()
    refused, _ = notified_job(Session, url)
    assert send_due(Session, 30.0)["retrying"] == [deliveries(Session, refused)[0].id]
    assert "ConnectionRefusedError" in deliveries(Session, refused)[0].last_error
    with Receiver() as receiver:
        receiver.answer = 307   # a redirect is never followed: the event goes only where it was set to
        redirected, endpoint = notified_job(Session, receiver.url("b"))
        receiver.secrets["b"] = endpoint.secret
        send_due(Session, 30.0)
    assert deliveries(Session, redirected)[0].last_error.startswith("HTTP 307")
    assert [d.status for d in receiver.all()] == [307]


def test_migration_0014_goes_down_and_up_keeping_the_jobs(db_url, Session):
    from jobs.ledger import upgrade
    from ledger_helpers import downgraded_schema

    job_id, _ = notified_job(Session, "http://127.0.0.1:9/a")
    schema = downgraded_schema(db_url, "0013")
    assert "webhook_deliveries" not in schema
    assert "webhook_endpoint_id" not in schema["jobs"]
    upgrade(db_url)
    with Session() as s:
        job = ledger.get_job(s, job_id)
        assert job.status == "completed" and job.webhook_endpoint_id is None


@pytest.fixture
def Session(ledger):   # noqa: F811 — conftest's ledger fixture, on SQLite and PostgreSQL, but its sessions
    return ledger[1]
