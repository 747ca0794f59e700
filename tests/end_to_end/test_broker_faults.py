"""Nothing lost, nothing twice when the broker misbehaves: Redis redelivering a running
shard's message, Redis restarted mid-job (its queues lost), and a pickle message refused.
Real Celery workers (subprocesses) on real Redis with the tiny model; the invariant of
test_fault_tolerance.py is checked at the end of each."""
from __future__ import annotations

import contextlib
import os
import pickle
import re
import socket
import subprocess
import uuid
from collections import Counter

import redis

from polling import wait_until
from cluster import quick_then_held, long_rows


# --- Redis redelivers while the first copy still runs ---------------------------------------

def test_visibility_timeout_redelivery_never_duplicates(postgres_url, cluster_factory):
    """With a 2 s visibility timeout, Redis hands a running shard's message to the idle
    worker again and again; those copies find the shard leased and are dropped."""
    c = cluster_factory(postgres_url, PIPELINE_VISIBILITY_TIMEOUT=2)
    rows = long_rows("v", 4, 20) + long_rows("held-", 4, 64)   # shard 1 held until a copy of it came back
    workers = [c.start_worker(held=True), c.start_worker(held=True)]
    job_id = c.submit(rows, shard_size=4)

    # Held, shard 1 runs until released, so its message is redelivered (every 2 s) and a copy
    # dropped as busy, on any machine; a copy of shard 0 may be dropped so too meanwhile.
    c.wait_for("shard 1 held and a redelivered copy dropped as busy",
               lambda: any("held: held-" in c.log(p) for p in workers) and any("'busy'" in c.log(p) for p in workers))
    assert c.shards(job_id)[1].status == "running"
    c.release()
    job = c.wait_until_ended(job_id)
    assert job.status == "completed"
    c.assert_exactly_once(job_id, [r["id"] for r in rows])
    # no copy ever took a shard over: one attempt each, no release
    assert [(sh.attempt, sh.releases) for sh in c.shards(job_id)] == [(1, 0), (1, 0)]
    logs = c.all_logs()
    received = Counter(re.findall(r"Task pipeline\.run_shard\[([0-9a-f-]+)\] received", logs))
    assert max(received.values()) >= 2 and "'busy'" in logs, "no redelivery while a shard ran\n" + logs

# --- Redis restarted mid-job ------------------------------------------------------------------

@contextlib.contextmanager
def private_redis():
    """A Redis of this test's own (no persistence, like the shared one), so that restarting
    it cannot disturb anything else using the shared Redis; always shut down at the end."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"]

    def start():
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=port, socket_connect_timeout=1)
        wait_until(f"the private Redis on port {port} to answer", client.ping, timeout=20, poll_s=0.1,
                   retry=(redis.ConnectionError,))
        return proc

    state = {"proc": start()}

    def restart(noticed):
        """Stop Redis, wait until noticed() (the workers saw it gone), start it again, empty."""
        try:
            redis.Redis(port=port).shutdown(nosave=True)
        except redis.ConnectionError:  # the shutdown closes the connection
            pass
        state["proc"].wait(timeout=20)
        noticed()
        state["proc"] = start()

    try:
        yield f"redis://127.0.0.1:{port}/0", restart
    finally:
        proc = state["proc"]
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=20)


def test_redis_restart_mid_job_loses_nothing(postgres_url, cluster_factory):
    """Redis keeps nothing: the queued messages and the running shard's unacked one are
    gone. The running shard still commits through the ledger, the workers reconnect, and
    the reconciler re-enqueues the queued shards nobody has a message for. The worker holds
    its running shards mid-generation (tests/hold.py) until Redis is back."""
    with private_redis() as (broker, restart_redis):
        c = cluster_factory(postgres_url, broker_url=broker)
        rows = quick_then_held(3, 9)
        w = c.start_worker(held=True, PIPELINE_SHARDS_IN_FLIGHT=2)  # takes 2 of the 4 shards: 2 stay queued
        job_id = c.submit(rows, shard_size=3)
        c.wait_held(w)
        assert redis.Redis.from_url(broker).llen(c.shard_queue) > 0  # messages that the restart will lose
        restart_redis(lambda: c.wait_for("the worker to see the broker gone",
                                         lambda: "Connection to broker lost" in c.log(w)))
        assert redis.Redis.from_url(broker).llen(c.shard_queue) == 0
        c.release()
        job = c.wait_until_ended(job_id)
        assert job.status == "completed" and job.completed_requests == 12
        c.assert_exactly_once(job_id, [r["id"] for r in rows])
        assert "recovery: {'reenqueued'" in c.all_logs() or "'reenqueued': [" in c.all_logs()

# --- pickle refused ---------------------------------------------------------------------------

class _MakeDirOnUnpickle:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return os.makedirs, (self.path,)


def test_a_pickle_message_is_refused_and_the_worker_keeps_going(sqlite_url, cluster_factory, tmp_path):
    c = cluster_factory(sqlite_url)
    w = c.start_worker()
    marker = tmp_path / "pwned"
    from workers.app import app

    body = pickle.dumps(((_MakeDirOnUnpickle(str(marker)), 0), {}, {}))
    task_id = str(uuid.uuid4())
    with app.connection_for_write(c.broker_url) as conn, conn.Producer() as producer:
        producer.publish(body, routing_key=c.shard_queue, exchange="", content_type="application/x-python-serialize",
                         content_encoding="binary",
                         headers={"lang": "py", "task": "pipeline.run_shard", "id": task_id, "root_id": task_id,
                                  "argsrepr": "(...)", "kwargsrepr": "{}"},
                         declare=[])
    refusal = "Refusing to deserialize untrusted content of type pickle"
    c.wait_for("the refusal in the worker log", lambda: refusal in c.log(w), timeout=60)
    assert "The message has been ignored and discarded" in c.log(w)
    rows = [{"id": "after", "prompt": "Hi", "max_tokens": 2}]
    job_id = c.submit(rows, shard_size=1)
    assert c.wait_until_ended(job_id).status == "completed"
    c.assert_exactly_once(job_id, ["after"])
    assert not marker.exists() and w.poll() is None
    assert redis.Redis.from_url(c.broker_url).llen(c.shard_queue) == 0  # not left to be redelivered forever
