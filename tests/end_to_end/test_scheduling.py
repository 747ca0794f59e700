"""Nightly scheduling with real Redis and real workers: priorities (kombu message priorities,
and the engine gate letting higher-priority shards in first), completion windows (expiry,
batch_expired rows, retry) and back-pressure (PIPELINE_MAX_QUEUED_REQUESTS)."""
from __future__ import annotations

import json
from collections import Counter
from datetime import timedelta

import pytest
from click.testing import CliRunner
from sqlalchemy import update

from jobs import ledger
from jobs.results.openai_output import output_line
from jobs.paths import JobPaths
from jobs.results.parquet_files import read_results
from jobs.scheduling import EXPIRED_CODE, parse_window, priority_rank
from jobs.settings import Settings
from jobs.submission import create_job_from_file
from cli import main
from cli.errors import EXIT_OVER_CAPACITY
from cluster import FAST, Cluster, long_rows, write_jsonl
from workers import broker
from workers.recovery import recover

FAST_ARGS = ["--kv-cache-gib", str(FAST["kv_cache_gib"]), "--device", FAST["device"]]


def small_batch_worker(c: Cluster, in_flight: int, max_num_seqs: int = 2, held: bool = False):
    """A worker whose engine batch holds 2 sequences (so about two 2-request shards run at
    once) and that reserves `in_flight` shard messages: the rest wait at its gate. held:
    with tests/hold.py's hold of "held-" requests."""
    engines = json.dumps([{**c.engine_options, "max_num_seqs": max_num_seqs}])   # not in the engine key
    proc = c.start_worker(held=held, PIPELINE_WORKER_ENGINES=engines, PIPELINE_SHARDS_IN_FLIGHT=in_flight)
    c.wait_for("the worker's engine", lambda: " loaded in " in c.log(proc), timeout=120)
    return proc


def submit(c: Cluster, tmp_path, rows, *args) -> str:
    src = write_jsonl(tmp_path / f"in-{rows[0]['id']}.jsonl", rows)
    done = c.cli("submit", str(src), "--model", str(c.model_dir), *FAST_ARGS, *args)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_windows_and_priorities_parse():
    assert [parse_window(w) for w in ("24h", "8h", "30m", "20s")] == [
        timedelta(hours=24), timedelta(hours=8), timedelta(minutes=30), timedelta(seconds=20)]
    for bad in ("", "0s", "1.5h", "8 hours", "-1m", "24h ", " 24h", "\uff12\uff14h", "31d", "721h",
                "99999999999999999999h", "3000000d", None):
        with pytest.raises(ValueError):
            parse_window(bad)
    assert parse_window("30d") == parse_window("720h") == timedelta(days=30)
    assert [priority_rank(p) for p in ("high", "normal", "low", None)] == [0, 1, 2, 1]


def test_a_high_priority_job_goes_before_the_low_jobs_waiting_shards(sqlite_url, cluster_factory, tmp_path):
    c = cluster_factory(sqlite_url)
    small_batch_worker(c, in_flight=8)   # reserves 8 low shards: 6 of them wait at the gate
    low = submit(c, tmp_path, long_rows("low-", 32, 12), "--shard-size", "2", "--priority", "low")
    c.wait_for("the low job to run", lambda: any(sh.status == "running" for sh in c.shards(low)))
    src = write_jsonl(tmp_path / "high.jsonl", long_rows("high-", 2, 4))
    high, sizes = create_job_from_file(c.Session, c.root, src, model=str(c.model_dir),
                                       engine_options=c.engine_options, shard_size=2, priority="high")
    enqueued_at = ledger.models.utcnow()
    broker.enqueue_job(Settings.from_env(c.env), high, len(sizes), c.job(high).engine_key, "high")
    done = c.wait_until_ended(high)
    assert (done.status, done.priority, c.job(low).priority) == ("completed", "high", "low")
    # Counted from the high job's arrival (how many low shards ran before it depends only on
    # the machine's speed). The worker holds 8 low messages; the high one is fetched when
    # a low task ends (late ack), then goes first at the gate. Measured: it starts after 4-5
    # low boundaries, not at the very next one; without priorities all 13 queued low shards
    # would go before it.
    overtaking = [sh.index for sh in c.shards(low)
                  if sh.started_at and enqueued_at <= sh.started_at <= done.finished_at]
    assert len(overtaking) <= 6, f"low shards {overtaking} started after the high job arrived and before it ended"
    assert c.wait_until_ended(low).status == "completed"
    # Within one priority, first in first out, up to the order in which the worker's threads
    # bring the 8 messages it reserved at once to its gate: those 8 start first.
    order = [sh.index for sh in sorted(c.shards(low), key=lambda sh: sh.started_at)]
    assert sorted(order[:8]) == list(range(8)) and order[-1] >= 12, order


def test_a_job_past_its_window_expires_keeping_its_answers_and_retry_runs_the_rest(
        sqlite_url, cluster_factory, tmp_path):
    c = cluster_factory(sqlite_url)
    # One shard at a time, 16 shards of 2 requests. The deadline is moved to now once the
    # first shard has committed and the second is held four tokens in (tests/hold.py: the
    # clock jumping past the window, whatever the machine's speed: a real 20 s window was
    # outrun by a fast CI machine), so the job has answers and 15 shards of work left when it
    # expires; the expiry is what ends the hold.
    worker = small_batch_worker(c, in_flight=1, held=True)
    rows = long_rows("w-", 2, 32) + long_rows("held-", 30, 32)
    ids = [r["id"] for r in rows]
    job_id = submit(c, tmp_path, rows, "--shard-size", "2", "--completion-window", "30m")
    assert c.job(job_id).expires_at is not None
    c.wait_held(worker)
    assert [sh.status for sh in c.shards(job_id)][:3] == ["completed", "running", "queued"]
    with c.Session() as s:
        s.execute(update(ledger.Job).where(ledger.Job.id == job_id).values(expires_at=ledger.utcnow()))
        s.commit()
    job = c.wait_until_ended(job_id)
    assert job.status == "expired"
    table = read_results(JobPaths(c.root, job_id).results_dir).to_pylist()
    assert Counter(r["id"] for r in table) == Counter(ids)   # each id exactly once
    answered = [r for r in table if r["finish_reason"] in ("stop", "length")]
    expired = [r for r in table if r["finish_reason"] == "error"]
    assert sorted(r["id"] for r in answered) == ["w-000", "w-001"] and len(expired) == 30
    assert all(r["error"].startswith(f"{EXPIRED_CODE}:") for r in expired)
    line = output_line(expired[0], endpoint="/v1/completions", model="m", created=0)
    assert line["error"]["code"] == EXPIRED_CODE
    assert (job.completed_requests, job.failed_requests) == (len(answered), len(expired))
    assert sum(sh.failed_requests for sh in c.shards(job_id)) == len(expired)
    # (A shard the expiry cut in the middle keeps the answers it had, here none: its two
    # requests were held four tokens in; expired rows carry no partial text.)
    # here, in full batches (the job's own engine options), rather than one at a time on the worker
    retry = c.cli("retry", job_id, "--completion-window", "10m", "--local")
    assert retry.returncode == 0, retry.stderr
    retry_id = retry.stdout.split()[0]   # then --local's summary
    assert c.job(retry_id).total_requests == len(expired)
    c.assert_answered_once([job_id, retry_id], ids)


def test_recovery_expires_a_job_no_worker_holds(sqlite_url, tmp_path, data_root, tiny_model_dir):
    Session = ledger.session_factory(ledger.make_engine(sqlite_url))
    src = write_jsonl(tmp_path / "in.jsonl", long_rows("r-", 5, 4))
    job_id, _ = create_job_from_file(Session, data_root, src, model="m", engine_options={}, shard_size=2,
                                     completion_window="30m")
    sent = []
    report = recover(Session, data_root, max_attempts=2, queued_grace_s=60,
                     enqueue=lambda route, shards: sent.append(shards), backlog=lambda route: 0)
    assert report["expired"] == [] and not sent   # not due yet
    with Session() as s:   # the clock past the window (a 1 s window was sometimes past at the first pass)
        s.execute(update(ledger.Job).where(ledger.Job.id == job_id).values(expires_at=ledger.utcnow()))
        s.commit()
    report = recover(Session, data_root, max_attempts=2, queued_grace_s=60,
                     enqueue=lambda route, shards: sent.append(shards), backlog=lambda route: 0)
    assert report["expired"] == [job_id] and job_id in report["finalized"] and not sent
    with Session() as s:
        job = ledger.get_job(s, job_id)
    assert (job.status, job.completed_requests, job.failed_requests) == ("expired", 0, 5)
    rows = read_results(JobPaths(data_root, job_id).results_dir).to_pylist()
    assert sorted(r["id"] for r in rows) == [f"r-{i:03d}" for i in range(5)]
    assert {r["error"].split(":")[0] for r in rows} == {EXPIRED_CODE}


def test_back_pressure_refuses_a_job_and_creates_nothing(sqlite_url, cluster_factory, tmp_path):
    c = cluster_factory(sqlite_url)   # no worker: what is submitted stays queued
    first = submit(c, tmp_path, long_rows("a-", 4, 4))
    queued_before = broker.backlog(Settings.from_env(c.env), c.shard_queue)
    assert queued_before == 1
    jobs_dir = c.root / "jobs"
    dirs_before = sorted(p.name for p in jobs_dir.iterdir())
    src = write_jsonl(tmp_path / "b.jsonl", long_rows("b-", 4, 4))
    env = {k: v for k, v in c.env.items() if k.startswith("PIPELINE_")}
    result = CliRunner().invoke(main, ["submit", str(src), "--model", str(c.model_dir), *FAST_ARGS],
                                env={**env, "PIPELINE_MAX_QUEUED_REQUESTS": "6"})
    assert result.exit_code == EXIT_OVER_CAPACITY, result.output
    assert "nothing was created" in result.output and "PIPELINE_MAX_QUEUED_REQUESTS" in result.output
    with c.Session() as s:
        assert [j.id for j in ledger.list_jobs(s)] == [first]
    assert sorted(p.name for p in jobs_dir.iterdir()) == dirs_before
    assert broker.backlog(Settings.from_env(c.env), c.shard_queue) == queued_before
    # within the limit it is taken
    result = CliRunner().invoke(main, ["submit", str(src), "--model", str(c.model_dir), *FAST_ARGS],
                                env={**env, "PIPELINE_MAX_QUEUED_REQUESTS": "8"})
    assert result.exit_code == 0, result.output


def test_list_and_status_show_priority_deadline_and_time_left(sqlite_url, tmp_path, data_root, monkeypatch):
    Session = ledger.session_factory(ledger.make_engine(sqlite_url))
    src = write_jsonl(tmp_path / "in.jsonl", long_rows("d-", 2, 4))
    job_id, _ = create_job_from_file(Session, data_root, src, model="m", engine_options={}, shard_size=2,
                                     completion_window="8h", priority="high")
    # The CLI's clock (jobs.ledger.utcnow, read when it renders) half a minute after the job
    # was created, however long the commands below take on this machine.
    with Session() as s:
        created = ledger.get_job(s, job_id).created_at
    monkeypatch.setattr(ledger, "utcnow", lambda: created + timedelta(seconds=30))
    env = {"PIPELINE_DATA_DIR": str(data_root), "PIPELINE_DATABASE_URL": sqlite_url,
           "COLUMNS": "250"}
    listed = CliRunner().invoke(main, ["list"], env=env)
    assert listed.exit_code == 0 and "high" in listed.output and "7h 59m left" in listed.output, listed.output
    status = CliRunner().invoke(main, ["status", job_id], env=env)
    assert status.exit_code == 0 and "window 8h" in status.output and "7h 59m left" in status.output, status.output
    as_json = json.loads(CliRunner().invoke(main, ["status", job_id, "--json"], env=env).output)
    assert as_json["pipeline"]["priority"] == "high" and as_json["completion_window"] == "8h"
