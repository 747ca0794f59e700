"""Webhooks end to end: real `pipeline submit --notify`, real workers posting from their
sender threads, real `pipeline serve` with a key's endpoint (`pipeline keys webhook`), and a
real HTTP receiver (tests/webhook_receiver.py) that verifies every delivery with the openai
package's own verifier; SQLite and PostgreSQL ledgers, real Redis."""
from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner
from openai.types.webhooks import BatchCancelledWebhookEvent, BatchCompletedWebhookEvent

from api_helpers import CHATS, batch_line, jsonl, serving, wait_until_ended
from cli import main
from cluster import FAST, Cluster, write_jsonl
from jobs import ledger
from jobs.paths import default_database_url
from jobs.webhooks import new_secret
from polling import wait_until
from webhook_receiver import Receiver

FAST_ARGS = ["--kv-cache-gib", str(FAST["kv_cache_gib"]), "--device", FAST["device"]]
QUICK = {"PIPELINE_WEBHOOK_BACKOFF_SECONDS": "0.3"}   # retries in a second or so, not minutes


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_url(request):
    return request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "postgres_url")


def submit(c: Cluster, tmp_path, prefix: str, *args) -> tuple[str, str]:
    rows = [{"id": f"{prefix}{i}", "prompt": f"Say {i}", "max_tokens": 4} for i in range(3)]
    src = write_jsonl(tmp_path / f"{prefix}.jsonl", rows)
    done = c.cli("submit", str(src), "--model", str(c.model_dir), *FAST_ARGS, "--shard-size", "2", *args)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip(), done.stderr


def deliveries(c: Cluster, job_id: str) -> list:
    with c.Session() as s:
        return [d for d, _ in ledger.deliveries_of_job(s, job_id)]


def test_a_cli_job_with_notify_gets_batch_completed(ledger_url, cluster_factory, tmp_path):
    c = cluster_factory(ledger_url, **QUICK)
    with Receiver() as receiver:
        c.start_worker()
        url = receiver.url("nightly")
        first, said = submit(c, tmp_path, "a-", "--notify", url)
        receiver.secrets["nightly"] = re.search(r"whsec_\S+", said)[0]   # shown once, on stderr
        second, said_again = submit(c, tmp_path, "b-", "--notify", url)
        assert "whsec_" not in said_again   # the URL keeps its secret
        for job_id in (first, second):
            assert c.wait_until_ended(job_id).status == "completed"
            c.wait_for(f"{job_id}'s event delivered",
                       lambda job_id=job_id: [d.status for d in deliveries(c, job_id)] == ["delivered"])
        events = receiver.accepted("nightly")   # (it answers before the sender records the 2xx)
    assert sorted(e.data.id for e in events) == sorted([first, second])
    for event in events:
        assert isinstance(event, BatchCompletedWebhookEvent) and event.type == "batch.completed"
        (d,) = deliveries(c, event.data.id)
        assert (d.id, d.status) == (event.id, "delivered")
        assert event.created_at == int(c.job(event.data.id).finished_at.timestamp())
    assert len(receiver.accepted()) == 2 and not receiver.refused_signatures()
    status = c.cli("status", first)
    assert f"webhook: batch.completed ({events[0].id if events[0].data.id == first else events[1].id}) to {url}: " \
           "delivered" in status.stdout, status.stdout


def test_a_receiver_down_for_a_while_gets_each_event_once_when_it_is_back(ledger_url, cluster_factory, tmp_path):
    """503 first, then connections refused, then up: every attempt is in the ledger; once
    back the receiver gets each event once (two workers sweep at once), and a pass after
    that sends nothing."""
    c = cluster_factory(ledger_url, **QUICK)
    secret = new_secret()
    receiver = Receiver()
    receiver.answer, receiver.secrets["down"] = 503, secret
    receiver.start()
    try:
        c.start_worker()
        c.start_worker()
        url = receiver.url("down")
        jobs = [submit(c, tmp_path, "a-", "--notify", url, "--notify-secret", secret)[0],
                submit(c, tmp_path, "b-", "--notify", url)[0]]   # the URL's secret: the one given
        c.wait_for("two 503s for each event", lambda: all(
            len(ds := deliveries(c, job)) == 1 and ds[0].attempts >= 2 and ds[0].last_error.startswith("HTTP 503")
            for job in jobs))
        status = c.cli("status", jobs[0]).stdout
        assert re.search(r"webhook: batch.completed \(evt_\w+\) to \S+: (pending: attempt \d+ failed \(HTTP 503 "
                         r"|attempt \d+ being sent)", status), status
        receiver.stop()
        c.wait_for("a refused attempt for each event", lambda: all(
            "Refused" in (deliveries(c, job)[0].last_error or "") for job in jobs))
        receiver.answer = 204
        receiver.start()
        c.wait_for("both events delivered", lambda: all(deliveries(c, job)[0].status == "delivered" for job in jobs))
        again = c.cli("recover")   # one more pass, at once: nothing to send
        assert again.returncode == 0 and json.loads(again.stdout)["webhooks"]["delivered"] == [], again.stdout
    finally:
        receiver.stop()
    events = receiver.accepted("down")
    assert sorted(e.data.id for e in events) == sorted(jobs)
    assert sorted(e.id for e in events) == sorted(deliveries(c, job)[0].id for job in jobs)
    for job in jobs:
        (d,) = deliveries(c, job)
        seen = [r for r in receiver.all() if r.headers["webhook-id"] == d.id]
        assert [r.status for r in seen].count(204) == 1 and len({r.body for r in seen}) == 1
        assert d.attempts > len(seen) >= 3   # the refused attempts never reached it
    assert not receiver.refused_signatures()


def test_a_keys_batches_post_completed_and_cancelled_and_another_keys_nothing(tmp_path, monkeypatch,
                                                                             bundled_model_dir):
    monkeypatch.setenv("PIPELINE_RECOVERY_INTERVAL", "1")   # the worker's sender passes
    monkeypatch.setenv("PIPELINE_WEBHOOK_BACKOFF_SECONDS", "0.3")
    with Receiver() as receiver, serving(tmp_path, with_worker=True, held=True) as server:
        done = CliRunner().invoke(main, ["keys", "webhook", "team-a", receiver.url("team-a")], env=server.env)
        assert done.exit_code == 0, done.output
        receiver.secrets["team-a"] = done.stdout.strip()
        listed = CliRunner().invoke(main, ["keys", "list"], env=server.env).stdout
        assert "team-a  created" in listed and f"webhook {receiver.url('team-a')}" in listed

        def create(client, rows):
            upload = client.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
            return client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                         completion_window="24h")

        quiet = server.client(server.keys["team-b"])   # a key without a webhook
        silent = wait_until_ended(quiet, create(quiet, [batch_line("b", CHATS["greet"], max_tokens=4)]).id)
        client = server.client()
        completed = wait_until_ended(client, create(client, [batch_line("a", CHATS["greet"], max_tokens=4)]).id)
        story = [{"role": "user", "content": "Tell me a story."}]   # not an answer stored already
        parked = create(client, [batch_line("parked-0", story, max_tokens=4)])   # never answers (tests/hold.py)
        client.batches.cancel(parked.id)
        cancelled = wait_until_ended(client, parked.id, timeout=60)
        Session = ledger.open_sessions(default_database_url(server.root))

        def delivered(batch) -> bool:
            with Session() as s:
                return [d.status for d, _ in ledger.deliveries_of_job(s, batch.id)] == ["delivered"]

        wait_until("team-a's events delivered", lambda: delivered(completed) and delivered(cancelled), timeout=60)
        events = receiver.accepted("team-a")
    assert (silent.status, completed.status, cancelled.status) == ("completed", "completed", "cancelled")
    by_batch = {e.data.id: e for e in events}
    assert len(events) == 2 and isinstance(by_batch[completed.id], BatchCompletedWebhookEvent)
    assert isinstance(by_batch[cancelled.id], BatchCancelledWebhookEvent) and by_batch[cancelled.id].object == "event"
    assert by_batch[cancelled.id].created_at == cancelled.cancelled_at
    with Session() as s:   # it ended before team-a's batches did, so its event would have been made first
        assert ledger.deliveries_of_job(s, silent.id) == []
    Session.kw["bind"].dispose()


def test_bad_webhook_options_are_usage_errors(runner, data_root, tmp_path):
    env = {"PIPELINE_DATA_DIR": str(data_root)}
    assert runner.invoke(main, ["keys", "add", "team-a"], env=env).exit_code == 0
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "Hi"}])
    for args in (["keys", "webhook", "team-a"], ["keys", "webhook", "team-a", "ftp://example.com/x"],
                 ["keys", "webhook", "team-a", "http://example.com/x", "--remove"],
                 ["keys", "webhook", "nobody", "http://example.com/x"],
                 ["submit", str(src), "--notify", "example.com/hook"],
                 ["submit", str(src), "--notify", "http://example.com/x", "--notify-secret", "whsec_short"]):
        done = runner.invoke(main, args, env=env)
        assert done.exit_code == 2, (args, done.output)
    made = runner.invoke(main, ["keys", "webhook", "team-a", "https://example.com/hook"], env=env)
    assert made.exit_code == 0 and made.stdout.startswith("whsec_") and len(made.stdout.splitlines()) == 1
    assert "webhook https://example.com/hook" in runner.invoke(main, ["keys", "list"], env=env).stdout
    removed = runner.invoke(main, ["keys", "webhook", "team-a", "--remove"], env=env)
    assert removed.exit_code == 0 and "webhook" not in runner.invoke(main, ["keys", "list"], env=env).stdout
