"""Webhook signing and event bodies (jobs.webhooks): the Standard Webhooks spec's own test
vector, and every event read back by the openai package's verifier as OpenAI's own types."""
from __future__ import annotations

import base64
from datetime import datetime, timezone

import openai
import pytest
from openai.types.webhooks import (
    BatchCancelledWebhookEvent, BatchCompletedWebhookEvent, BatchExpiredWebhookEvent, BatchFailedWebhookEvent,
)

from jobs.ledger.statuses import JobStatus
from jobs.webhooks import (
    EVENT_TYPES, MAX_DELAY_S, check_url, event_body, headers, new_secret, retry_delay, secret_key, sign,
)


def test_the_signature_is_the_standard_webhooks_test_vector():
    """standard-webhooks' libraries/python/tests/test_webhooks.py, test_sign_function."""
    assert sign("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330,
                '{"test": 2432232314}') == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
    assert sign("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330,
                b'{"test": 2432232314}') == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


@pytest.mark.parametrize("status, event_class", [
    (JobStatus.COMPLETED, BatchCompletedWebhookEvent), (JobStatus.FAILED, BatchFailedWebhookEvent),
    (JobStatus.EXPIRED, BatchExpiredWebhookEvent), (JobStatus.CANCELLED, BatchCancelledWebhookEvent)])
def test_openai_unwraps_each_event_we_sign_as_its_own_type(status, event_class):
    secret, ended = new_secret(), datetime(2026, 12, 6, 3, 0, 5, tzinfo=timezone.utc)
    body = event_body("evt_0123", EVENT_TYPES[status], "job_0123456789abcdef", ended)
    head = headers(secret, "evt_0123", int(datetime.now(timezone.utc).timestamp()), body)
    event = openai.OpenAI(api_key="x", webhook_secret=secret).webhooks.unwrap(body, head)
    assert isinstance(event, event_class)
    assert (event.id, event.object, event.type, event.data.id, event.created_at) == (
        "evt_0123", "event", EVENT_TYPES[status], "job_0123456789abcdef", int(ended.timestamp()))
    assert head["webhook-id"] == "evt_0123" and head["content-type"] == "application/json"


def test_every_way_a_job_ends_has_its_event():
    assert set(EVENT_TYPES) == {str(s) for s in JobStatus.terminal()}


def test_the_verifier_refuses_another_secret_another_body_and_an_old_timestamp():
    secret, now = new_secret(), int(datetime.now(timezone.utc).timestamp())
    body = event_body("evt_1", "batch.completed", "job_0123456789abcdef", datetime.now(timezone.utc))
    webhooks = openai.OpenAI(api_key="x", webhook_secret=secret).webhooks
    for payload, head in ((body, headers(new_secret(), "evt_1", now, body)),
                          (body.replace("job_0", "job_1"), headers(secret, "evt_1", now, body)),
                          (body, headers(secret, "evt_1", now - 600, body))):
        with pytest.raises(openai.InvalidWebhookSignatureError):
            webhooks.unwrap(payload, head)


def test_secrets_are_whsec_base64_of_24_to_64_bytes():
    secret = new_secret()
    assert secret.startswith("whsec_") and len(secret_key(secret)) == 32 and new_secret() != secret
    for bad in ("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "whsec_not base64!",
                "whsec_" + base64.b64encode(b"x" * 16).decode(), "whsec_" + base64.b64encode(b"x" * 65).decode()):
        with pytest.raises(ValueError):
            secret_key(bad)


def test_urls_are_http_or_https_with_a_host():
    assert check_url("https://hooks.example.com/batch") == "https://hooks.example.com/batch"
    for bad in ("ftp://example.com/x", "http:///nohost", "example.com/hook", "file:///etc/passwd"):
        with pytest.raises(ValueError):
            check_url(bad)


def test_the_retry_delay_doubles_from_the_base_up_to_an_hour_with_a_little_jitter():
    for attempts, expected in ((1, 10), (2, 20), (3, 40), (9, 2560), (10, MAX_DELAY_S), (30, MAX_DELAY_S)):
        for _ in range(20):
            assert expected <= retry_delay(attempts, 10.0) <= expected * 1.1
    assert sum(retry_delay(n, 10.0) for n in range(1, 40)) > 86400   # a day's retries never run dry
