"""Monitoring with real parts: a real worker's /metrics against the ledger and the Parquet
results, a real Prometheus (Debian's package) scraping a worker and `pipeline metrics`,
real Flower listing the shard tasks, a prefork worker's one endpoint for all its children,
and JSON logs; in-process, what run_shard, the engine loop and the reaper count, the
ledger-and-broker exporter on both ledgers, and `pipeline run --metrics-port`."""
from __future__ import annotations

import base64
import contextlib
import io
import json
import logging
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections import Counter
from datetime import timedelta
from pathlib import Path

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from jobs.ledger import claim_shard, get_job, make_engine, request_cancel, session_factory
from jobs.submission import create_job_from_file
from pipeline import Engine, EngineConfig, Request
from cli import main
from pipeline.engine_key import engine_key
from pipeline.engine.engine_loop import EngineLoop
from dashboards import dashboard_queries
from engine_helpers import greedy, random_prompt
from cluster import REPO, TOO_LONG_FOR_TINY, WAIT_S, write_jsonl
from shard_helpers import another_worker_takes_over, cancel, run_with_a_quick_request_first, submit
from worker_process import BROKER_URL, drop_queue
from workers import logs, metrics
from workers.shard_runner import ShardOutcome, run_shard

HOST = socket.gethostname()   # the worker label of this process's series
PROMETHEUS_MISSING = ("the Prometheus server binary is not on PATH: install Debian's package "
                      "(`apt-get install -y prometheus`; .ci/run does it)")


# --- helpers ------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get(url: str, auth: str | None = None, timeout: float = 10) -> bytes:
    request = urllib.request.Request(url)
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read()


def wait_until(what: str, predicate, timeout: float = WAIT_S, poll_s: float = 0.5, logs_of=None):
    """predicate()'s first truthy value; errors while waiting (a server not up yet) are retried."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except (OSError, ValueError, KeyError) as e:
            last = e
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last error: {last!r})"
                         + (f"\n{logs_of.all_logs()}" if logs_of is not None else ""))


def scrape(port: int) -> list:
    """Every sample of a /metrics endpoint, parsed by prometheus_client's own parser."""
    text = get(f"http://127.0.0.1:{port}/metrics").decode()
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def value(samples, name: str, **labels) -> float:
    """The sum of the samples called name whose labels include these."""
    return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())


def in_process(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def expected_from_results(job, table) -> dict:
    """What a worker's counters must say after this job alone: from the ledger and the Parquet rows."""
    rows = table.to_pylist()
    ran = [r for r in rows if r["ttft_s"] is not None]
    assert sum(r["output_tokens"] for r in rows) == job.output_tokens
    return {"generated": job.output_tokens, "prompt": job.prompt_tokens, "cached": job.cached_tokens,
            "reasons": Counter(r["finish_reason"] for r in rows), "ran": len(ran),
            "latency_sum": sum(r["latency_s"] for r in ran)}


def check_worker_counters(samples, job, table, num_shards: int) -> None:
    want = expected_from_results(job, table)
    assert value(samples, "pipeline_generated_tokens_total") == want["generated"] > 0
    assert value(samples, "pipeline_prompt_tokens_total") == want["prompt"]
    # the rows' shared prefix: the prefix cache serves some of their prompt tokens
    assert value(samples, "pipeline_cached_prompt_tokens_total") == want["cached"] > 0
    for reason, n in want["reasons"].items():
        assert value(samples, "pipeline_requests_total", finish_reason=reason) == n, reason
    assert value(samples, "pipeline_requests_total") == table.num_rows
    assert value(samples, "pipeline_shards_total", outcome="completed") == num_shards
    assert value(samples, "pipeline_time_to_first_token_seconds_count") == want["ran"]
    assert value(samples, "pipeline_request_latency_seconds_count") == want["ran"]
    assert value(samples, "pipeline_request_latency_seconds_bucket", le="+Inf") == want["ran"]
    assert value(samples, "pipeline_request_latency_seconds_sum") == pytest.approx(want["latency_sum"])
    assert value(samples, "pipeline_engine_step_seconds_count") > 0
    # nothing left running once the job is done
    for gauge in ("pipeline_running_sequences", "pipeline_waiting_sequences", "pipeline_shards_in_flight",
                  "pipeline_kv_cache_utilization"):
        assert value(samples, gauge) == 0, gauge


# The list: every one on a worker's endpoint, with its type; and the only labels there are.
WORKER_METRICS = {
    **dict.fromkeys(("pipeline_prompt_tokens", "pipeline_generated_tokens", "pipeline_cached_prompt_tokens",
                     "pipeline_draft_tokens", "pipeline_accepted_tokens", "pipeline_requests", "pipeline_shards", "pipeline_preemptions"), "counter"),
    **dict.fromkeys(("pipeline_running_sequences", "pipeline_waiting_sequences", "pipeline_kv_cache_utilization",
                     "pipeline_shards_in_flight"), "gauge"),
    **dict.fromkeys(("pipeline_time_to_first_token_seconds", "pipeline_request_latency_seconds",
                     "pipeline_engine_step_seconds"), "histogram"),
}
LOW_CARDINALITY_LABELS = {"model", "worker", "finish_reason", "outcome", "le"}


def check_worker_families(port: int) -> None:
    """The worker's endpoint has every metric of the issue with its type, and its series carry
    only low-cardinality labels (never a job or request id)."""
    families = {f.name: f for f in text_string_to_metric_families(get(f"http://127.0.0.1:{port}/metrics").decode())}
    assert {name: families[name].type for name in WORKER_METRICS if name in families} == WORKER_METRICS
    for family in families.values():
        if family.name.startswith("pipeline_"):
            assert family.samples, family.name   # each was written to, so each is there to query
            labels = {label for sample in family.samples for label in sample.labels}
            assert labels <= LOW_CARDINALITY_LABELS, (family.name, labels)


def json_log_of(cluster, worker) -> list[dict]:
    """Stop the worker, then read its whole log: every line must be one JSON object."""
    worker.terminate()
    worker.wait(timeout=60)
    records = []
    for number, line in enumerate(cluster.log(worker).splitlines(), 1):
        try:
            records.append(json.loads(line))
        except ValueError:
            pytest.fail(f"worker log line {number} is not JSON: {line!r}")
        assert {"time", "level", "logger", "message", "worker"} <= records[-1].keys(), line
    return records


def settled(port: int, num_shards: int):
    """The worker's samples once its num_shards are counted and nothing runs: a shard's counts
    land right after its commit, possibly just after the job ended, and a copy of a shard's
    message (a redelivery) may still be passing through run_shard for a moment."""
    samples = scrape(port)
    done = value(samples, "pipeline_shards_total", outcome="completed") == num_shards
    idle = value(samples, "pipeline_running_sequences") == value(samples, "pipeline_shards_in_flight") == 0
    return done and idle and samples


def submit_and_wait(cluster, rows, *args) -> str:
    src = write_jsonl(cluster.tmp_path / f"in-{uuid.uuid4().hex[:6]}.jsonl", rows)
    done = cluster.cli("submit", str(src), "--model", str(cluster.model_dir), "--kv-cache-gib", "0.05", "--wait",
                       *args)
    assert done.returncode == 0, done.stderr + cluster.all_logs()
    return done.stdout.strip()


# A few KV blocks of prompt that every request starts with: the prefix cache serves it.
SHARED_PREFIX = "You label the items of a nightly inventory, one short word for each item. " * 3


def some_rows(prefix: str, n: int) -> list[dict]:
    """Requests of a few lengths with a shared prompt prefix, and one whose prompt is too long
    for the tiny model (an error row)."""
    return [{"id": f"{prefix}{i}", "prompt": f"{SHARED_PREFIX}Item {i}", "max_tokens": 2 + i % 4,
             "ignore_eos": True} for i in range(n)] + [{"id": f"{prefix}-too-long", "prompt": TOO_LONG_FOR_TINY,
                                                       "max_tokens": 2}]


@contextlib.contextmanager
def prometheus(tmp_path: Path, targets: dict[str, int]):
    """A real Prometheus server on a free port scraping 127.0.0.1:PORT for each job name in
    targets every second, its data in a temporary directory; yields its query function."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail(PROMETHEUS_MISSING, pytrace=False)
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({   # JSON is YAML
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [{"job_name": name, "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
                           for name, port in targets.items()]}))
    port = free_port()
    log_path = tmp_path / "prometheus.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)

    def query(expr: str) -> list[dict]:
        answer = json.loads(get(f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})))
        assert answer["status"] == "success", answer
        return answer["data"]["result"]

    try:
        wait_until("Prometheus to be ready", lambda: get(f"http://127.0.0.1:{port}/-/ready"), timeout=60)
        yield query
    except BaseException:
        print(log_path.read_text(errors="replace")[-3000:])
        raise
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def query_value(query, expr: str) -> float | None:
    """The value of a query that yields one series (None while it yields none)."""
    result = query(expr)
    return float(result[0]["value"][1]) if len(result) == 1 else None


# --- real workers -------------------------------------------------------------------------------

def test_a_workers_metrics_agree_with_the_ledger_and_prometheus_scrapes_them(sqlite_url, cluster_factory, tmp_path):
    c = cluster_factory(sqlite_url)
    worker_port, exporter_port = free_port(), free_port()
    c.start_worker(PIPELINE_METRICS_PORT=worker_port)
    c.start_process("exporter", [sys.executable, "-m", "cli", "metrics", "--port", str(exporter_port)])
    with prometheus(tmp_path, {"pipeline-workers": worker_port, "pipeline-ledger": exporter_port}) as query:
        rows = some_rows("m", 10)
        job_id = submit_and_wait(c, rows, "--shard-size", "4")
        job, table = c.job(job_id), c.assert_exactly_once(job_id, [r["id"] for r in rows])
        assert job.status == "completed" and job.failed_requests == 1
        samples = wait_until("the worker's counters to cover the job's 3 shards", lambda: settled(worker_port, 3),
                             logs_of=c)
        check_worker_counters(samples, job, table, num_shards=3)
        check_worker_families(worker_port)
        assert {s.labels["model"] for s in samples if s.name == "pipeline_generated_tokens_total"} == \
            {c.model_dir.name}   # the model's name, never a path or a job id

        exported = scrape(exporter_port)
        assert value(exported, "pipeline_ledger_up") == value(exported, "pipeline_broker_up") == 1
        assert value(exported, "pipeline_jobs", status="completed") == 1
        # the worker's own model's queue (not the default one), reported though no job is left
        assert [s.value for s in exported if s.name == "pipeline_queue_messages"
                and s.labels["queue"] == c.shard_queue] == [0]

        # Prometheus scraped both: the numbers it stores are the ledger's
        wait_until("Prometheus to store the job's generated tokens",
                   lambda: sum(float(r["value"][1]) for r in query("pipeline_generated_tokens_total"))
                   == job.output_tokens, timeout=60)
        (series,) = query("pipeline_generated_tokens_total")
        assert series["metric"]["job"] == "pipeline-workers" and "worker" in series["metric"]
        assert query_value(query, 'sum(pipeline_requests_total{finish_reason="error"})') == 1
        wait_until("Prometheus to store the ledger's view",
                   lambda: query_value(query, 'pipeline_jobs{status="completed"}') == 1, timeout=60)
        assert {r["metric"]["job"]: r["value"][1] for r in query("up")} == \
            {"pipeline-workers": "1", "pipeline-ledger": "1"}
        for expr in dashboard_queries():   # the Grafana dashboard's queries are valid PromQL here
            query(expr)
        assert query_value(query, "sum(pipeline_engine_step_seconds_count)") == \
            value(samples, "pipeline_engine_step_seconds_count") > 0


def test_flower_lists_the_shard_tasks_and_json_logs_carry_the_shards_ids(sqlite_url, cluster_factory):
    c = cluster_factory(sqlite_url)
    port, auth = free_port(), "ops:night-shift"
    c.start_process("flower", [sys.executable, "-m", "celery", "-A", "workers.app", "flower", f"--port={port}",
                               "--address=127.0.0.1", f"--basic-auth={auth}"])
    wait_until("Flower to answer", lambda: get(f"http://127.0.0.1:{port}/healthcheck") == b"OK", timeout=60,
               logs_of=c)
    worker = c.start_worker(PIPELINE_LOG_FORMAT="json")
    rows = [{"id": f"f{i}", "prompt": f"Item {i}", "max_tokens": 3} for i in range(6)]
    job_id = submit_and_wait(c, rows, "--shard-size", "2")

    def shard_tasks():
        # This job's tasks (Redis is shared with other tests). Copies of a shard's message
        # may come too (the reconciler, with a 3 s grace here, or a redelivery): they end
        # "skipped" or "busy"; the task that ran each shard ends "completed".
        tasks = json.loads(get(f"http://127.0.0.1:{port}/api/tasks", auth=auth)).values()
        mine = [t for t in tasks if job_id in (t.get("args") or "")]
        ran = [t for t in mine if t.get("result") == "'completed'"]
        return len(ran) == 3 and (mine, ran)

    tasks, ran = wait_until("Flower to list the job's 3 shard tasks as succeeded", shard_tasks, timeout=60,
                            logs_of=c)
    assert {t["name"] for t in tasks} == {"pipeline.run_shard"}
    assert {t["state"] for t in ran} == {"SUCCESS"} and all(t["runtime"] > 0 for t in ran)
    assert sorted(t["args"] for t in ran) == [f"(job_id='{job_id}', shard={i})" for i in range(3)]
    assert {t["result"] for t in tasks if t["state"] == "SUCCESS"} <= {f"'{o}'" for o in ShardOutcome}
    with pytest.raises(urllib.error.HTTPError):   # the API is not open without its credentials
        get(f"http://127.0.0.1:{port}/api/tasks")

    records = json_log_of(c, worker)
    assert any("ready" in r["message"] for r in records)   # Celery's own records too
    assert any("Warm shutdown" in r["message"] for r in records)   # and its notices from signal handlers
    about = [r for r in records if r.get("job_id") == job_id]
    workers = {sh.index: sh.worker for sh in c.shards(job_id)}
    for index in range(3):
        mine = [r for r in about if r["shard"] == index]
        done = [r for r in mine if "succeeded" in r["message"] and "'completed'" in r["message"]]
        assert len(done) == 1, mine
        # the attempt that committed it, and the worker as the ledger names it
        assert (done[0]["attempt"], done[0]["worker"]) == (1, workers[index])
        assert all(r["task_id"] for r in mine)
        # the consumer's "received" line, before any task ran, names the shard and the task too
        assert any("received" in r["message"] and r["task_id"] == done[0]["task_id"] for r in mine)


def test_a_prefork_worker_serves_every_childs_numbers_on_one_port(sqlite_url, cluster_factory):
    """--concurrency 2: two engine processes, prometheus_client's multiprocess mode, one endpoint."""
    c = cluster_factory(sqlite_url)
    port = free_port()
    worker = c.start_worker(args=["--concurrency", "2", "--metrics-port", str(port), "--log-format", "json"])
    rows = some_rows("p", 7)
    job_id = submit_and_wait(c, rows, "--shard-size", "2")
    job, table = c.job(job_id), c.assert_exactly_once(job_id, [r["id"] for r in rows])
    workers = {sh.worker for sh in c.shards(job_id)}
    assert len(workers) == 2, f"both children should have run shards: {workers}"
    samples = wait_until("the counters of both children", lambda: settled(port, 4), logs_of=c)
    check_worker_counters(samples, job, table, num_shards=4)
    check_worker_families(port)
    # the children's records are JSON lines too, each naming its own process
    about = [r for r in json_log_of(c, worker) if r.get("job_id") == job_id and r.get("attempt")]
    assert {r["worker"] for r in about} == workers


def test_a_plain_celery_worker_serves_metrics_too_but_not_a_prefork_one_without_its_directory(
        sqlite_url, cluster_factory):
    """`celery -A workers.app worker` reads PIPELINE_METRICS_PORT as `pipeline worker` does; a
    prefork pool without PROMETHEUS_MULTIPROC_DIR would serve only the parent's numbers, so it
    serves none and says why."""
    c = cluster_factory(sqlite_url)
    solo_port, prefork_port = free_port(), free_port()
    c.start_worker(app="workers.app", pool="solo", PIPELINE_METRICS_PORT=solo_port)
    prefork = c.start_worker(app="workers.app", pool="prefork", PIPELINE_METRICS_PORT=prefork_port)
    samples = wait_until("the solo worker's endpoint", lambda: scrape(solo_port), timeout=60, logs_of=c)
    assert any(s.name == "process_cpu_seconds_total" for s in samples)
    wait_until("the prefork worker's refusal", lambda: "needs PROMETHEUS_MULTIPROC_DIR" in c.log(prefork),
               timeout=60, logs_of=c)
    with pytest.raises(OSError):
        scrape(prefork_port)


# --- in-process ---------------------------------------------------------------------------------

def test_run_shard_counts_only_what_it_commits(Session, data_root, tmp_path, engines, options):
    model = {"model": "tiny", "worker": HOST}
    series = {"generated": ("pipeline_generated_tokens_total", model),
              "prompt": ("pipeline_prompt_tokens_total", model),
              "ran": ("pipeline_time_to_first_token_seconds_count", model),
              **{reason: ("pipeline_requests_total", {**model, "finish_reason": reason})
                 for reason in ("length", "error", "cancelled")},
              **{outcome: ("pipeline_shards_total", {"worker": HOST, "outcome": outcome})
                 for outcome in ("completed", "skipped", "lost", "crashed", "busy")}}
    before = {key: in_process(name, **labels) for key, (name, labels) in series.items()}

    job_id = submit(Session, data_root, tmp_path, some_rows("r", 4), options)
    run = dict(engine_provider=engines.use, worker_name="t")
    assert run_shard(Session, data_root, job_id, 0, **run) == "completed"
    assert run_shard(Session, data_root, job_id, 0, **run) == "skipped"
    _, outcome = run_with_a_quick_request_first(Session, data_root, tmp_path, engines, options, 2,
                                                another_worker_takes_over, lease_s=0.3)
    assert outcome == "lost"   # it generated tokens but committed none: it counts none
    cancelled_id, outcome = run_with_a_quick_request_first(Session, data_root, tmp_path, engines, options, 2, cancel)
    assert outcome == "cancelled"
    crashing = submit(Session, data_root, tmp_path, some_rows("c", 1), {"model": str(tmp_path / "no-model")})
    with pytest.raises(Exception):
        run_shard(Session, data_root, crashing, 0, **run)
    assert run_shard(Session, data_root, crashing, 0, **run) == "busy"   # still leased to the crashed attempt

    grew = {key: in_process(name, **labels) - before[key] for key, (name, labels) in series.items()}
    with Session() as s:
        done, cancelled = get_job(s, job_id), get_job(s, cancelled_id)
    assert grew["generated"] == done.output_tokens + cancelled.output_tokens
    assert grew["prompt"] == done.prompt_tokens + cancelled.prompt_tokens
    assert grew["ran"] == 4 + 1   # the four that ran and the cancelled job's "quick" one
    assert [grew[r] for r in ("length", "error", "cancelled")] == [5, 1, 2]
    assert [grew[o] for o in ("completed", "skipped", "lost", "crashed", "busy")] == [1, 1, 1, 1, 1]
    assert in_process("pipeline_shards_total", worker=HOST, outcome="cancelled") >= 1
    assert in_process("pipeline_shards_in_flight", worker=HOST) == 0


def test_the_reaper_counts_the_shards_it_gives_up(Session, data_root, tmp_path):
    from sqlalchemy import update

    from jobs.ledger import Shard, utcnow
    from workers.recovery import recover

    before = (in_process("pipeline_requests_total", model="tiny", worker=HOST, finish_reason="error"),
              in_process("pipeline_shards_total", worker=HOST, outcome="failed"))
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": "Hi"} for i in range(3)])
    job_id = create_job_from_file(Session, data_root, src, model="tiny", engine_options={}, shard_size=3)[0]
    with Session() as s:
        assert claim_shard(s, job_id, 0, "gone:1", 60, 1) == 1
        s.execute(update(Shard).values(lease_expires_at=utcnow() - timedelta(seconds=5)))
        s.commit()
    report = recover(Session, data_root, max_attempts=1, queued_grace_s=60, enqueue=lambda route, shards: None,
                     backlog=lambda route: 0)
    assert report["exhausted"] == [(job_id, 0)]
    after = (in_process("pipeline_requests_total", model="tiny", worker=HOST, finish_reason="error"),
             in_process("pipeline_shards_total", worker=HOST, outcome="failed"))
    assert (after[0] - before[0], after[1] - before[1]) == (3, 1)


def test_the_engine_observer_sees_every_step_and_preemption(tiny_model_dir):
    """A pool too small for the batch: the loop's observer counts each step and each preemption."""
    engine = Engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=24, block_size=4,
                                 max_num_batched_tokens=64, max_num_seqs=64))
    labels = {"model": tiny_model_dir.name, "worker": HOST}
    before = (in_process("pipeline_engine_step_seconds_count", **labels),
              in_process("pipeline_preemptions_total", **labels))
    loop = EngineLoop(lambda: engine, observer=metrics.EngineObserver())
    try:
        import random
        rng = random.Random(1)
        requests = [Request(f"p{i}", prompt_token_ids=random_prompt(rng, n), params=greedy(m, ignore_eos=True))
                    for i, (n, m) in enumerate([(5, 20), (12, 16), (40, 12), (20, 20), (33, 8), (9, 24)])]
        assert len(list(loop.generate(requests))) == 6
        wait_until("the observer to see the engine idle", lambda: (
            in_process("pipeline_engine_step_seconds_count", **labels) - before[0] == engine.num_steps and
            in_process("pipeline_running_sequences", **labels) == 0), timeout=10, poll_s=0.05)
    finally:
        loop.close()
    assert engine.scheduler.num_preemptions > 0
    assert in_process("pipeline_preemptions_total", **labels) - before[1] == engine.scheduler.num_preemptions
    assert in_process("pipeline_waiting_sequences", **labels) == 0
    assert in_process("pipeline_kv_cache_utilization", **labels) == 0


def test_the_exporter_reports_queues_jobs_and_live_job_progress(db_url, data_root, tmp_path):
    from jobs.settings import Settings
    from workers.broker import announce, enqueue_job
    from workers.ledger_exporter import registry_for

    queue = f"pipeline-metrics-{uuid.uuid4().hex[:8]}"
    settings = Settings(data_dir=data_root, database_url=db_url, broker_url=BROKER_URL, queue=queue)
    engine = make_engine(db_url)
    Session = session_factory(engine)
    try:
        src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": "Hi"} for i in range(5)])
        job_id, sizes = create_job_from_file(Session, data_root, src, model="tiny", engine_options={}, shard_size=2)
        key = engine_key({})   # engine_options {}: the default engine's
        enqueue_job(settings, job_id, len(sizes), key)
        other = create_job_from_file(Session, data_root, src, model="tiny", engine_options={}, shard_size=5)[0]
        with Session() as s:
            assert claim_shard(s, other, 0, "w:1", 60, 3) == 1
        registry = registry_for(settings, Session)

        def sample(name, **labels):
            return registry.get_sample_value(name, labels)

        assert sample("pipeline_ledger_up") == sample("pipeline_broker_up") == 1
        assert sample("pipeline_queue_messages", queue=settings.queue_for(key)) == 3
        assert (sample("pipeline_jobs", status="queued"), sample("pipeline_jobs", status="in_progress"),
                sample("pipeline_jobs", status="completed")) == (1, 1, 0)
        assert sample("pipeline_job_requests", job_id=job_id) == 5
        assert sample("pipeline_job_requests_completed", job_id=job_id) == 0
        assert sample("pipeline_job_shards", job_id=job_id, status="queued") == 3
        assert sample("pipeline_job_shards", job_id=other, status="running") == 1
        with Session() as s:
            assert request_cancel(s, job_id)
        from jobs.results.finalize import finalize_job
        finalize_job(Session, data_root, job_id)
        assert sample("pipeline_jobs", status="cancelled") == 1
        assert sample("pipeline_job_requests", job_id=job_id) is None   # ended: its series are gone

        # per-model queues: a job's for another model, and an idle one that a live worker serves
        for_qwen, served = {"model": "/models/Qwen2.5-0.5B-Instruct"}, {"model": "/models/idle"}
        qwen_job = create_job_from_file(Session, data_root, src, model=for_qwen["model"], engine_options=for_qwen,
                                        shard_size=2)[0]
        enqueue_job(settings, qwen_job, 3, engine_key(for_qwen))
        announce(settings, [engine_key(served)], "celery@idle")
        assert sample("pipeline_queue_messages", queue=settings.queue_for(engine_key(for_qwen))) == 3
        assert sample("pipeline_queue_messages", queue=settings.queue_for(engine_key(served))) == 0
        announce(settings, [engine_key(served)], "celery@idle", gone=True)
        assert sample("pipeline_queue_messages", queue=settings.queue_for(engine_key(served))) is None

        down = Settings(data_dir=data_root, database_url=db_url, broker_url="redis://127.0.0.1:1/0", queue=queue)
        gone = session_factory(make_engine("postgresql+psycopg://nobody@127.0.0.1:1/none"))
        unreachable = registry_for(down, gone)
        assert unreachable.get_sample_value("pipeline_broker_up") == 0
        assert unreachable.get_sample_value("pipeline_ledger_up") == 0
    finally:
        drop_queue(queue)
        engine.dispose()


MULTIPROCESS_CHILDREN = """
import os
from prometheus_client import CollectorRegistry, generate_latest
from workers import metrics

def child(n):
    # a forked child that counts n tokens and has n shards in flight, says so, then waits to be told to go
    ready, go = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:
        metrics.SHARDS_IN_FLIGHT.labels("w").set(n)
        metrics.GENERATED_TOKENS.labels("m", "w").inc(n)
        os.write(ready[1], b"x")
        os.read(go[0], 1)
        os._exit(0)   # without mark_process_dead, as if killed
    os.read(ready[0], 1)
    return pid, go[1]

killed, go = child(5)
os.write(go, b"x")
os.waitpid(killed, 0)
alive, go = child(2)
registry = CollectorRegistry()
metrics._LiveProcessesCollector(registry)
print(generate_latest(registry).decode())
os.write(go, b"x")
os.waitpid(alive, 0)
"""


def test_multiprocess_mode_adds_up_the_children_and_forgets_the_dead_ones(tmp_path):
    """The prefork endpoint's collector: counters of every child (dead ones too: what they
    committed stays committed), live gauges only of the children still alive."""
    done = subprocess.run([sys.executable, "-c", MULTIPROCESS_CHILDREN], capture_output=True, text=True, cwd=REPO,
                          env={"PATH": "/usr/bin:/bin", "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}, timeout=60)
    assert done.returncode == 0, done.stderr
    samples = [s for family in text_string_to_metric_families(done.stdout) for s in family.samples]
    assert value(samples, "pipeline_generated_tokens_total") == 7
    assert value(samples, "pipeline_shards_in_flight") == 2


def test_pipeline_run_serves_its_metrics_while_it_runs(runner, data_root, tmp_path, tiny_model_dir):
    port = free_port()
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": "Hi", "max_tokens": 3} for i in range(4)])
    labels = {"model": tiny_model_dir.name, "worker": HOST}
    before = in_process("pipeline_generated_tokens_total", **labels)
    try:
        result = runner.invoke(main, ["run", str(src), "--model", str(tiny_model_dir), "--kv-cache-gib", "0.05",
                                      "--metrics-port", str(port)])
        assert result.exit_code == 0, result.output
        samples = scrape(port)   # the endpoint lives as long as the process
    finally:
        metrics.stop_serving()
    with session_factory(make_engine(f"sqlite:///{data_root / 'ledger.sqlite'}"))() as s:
        from jobs.ledger import list_jobs
        (job,) = list_jobs(s)
    assert value(samples, "pipeline_generated_tokens_total", **labels) - before == job.output_tokens == 12
    # a port already taken is a clear error before any job is created
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        result = runner.invoke(main, ["run", str(src), "--metrics-port", str(taken.getsockname()[1])])
    assert result.exit_code == 2 and "cannot serve metrics" in result.output


def test_json_records_carry_the_bound_shard_in_its_threads_only():
    stream = io.StringIO()
    logger = logging.getLogger(f"test-json-{uuid.uuid4().hex[:6]}")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    logger.addHandler(logging.StreamHandler(stream))
    logs.use_json(logger)
    token = logs.bind_shard("job_0123456789abcdef", 3, worker="celery@box:42", task_id="t-1")
    logs.bind_attempt(2)
    import contextvars
    keeper = threading.Thread(target=contextvars.copy_context().run, args=(logger.warning, "lease %s", "renewed"))
    keeper.start()
    keeper.join()
    logs.unbind(token)
    outsider = threading.Thread(target=logger.info, args=("not about a shard",))
    outsider.start()
    outsider.join()
    about, other = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert {k: about[k] for k in ("job_id", "shard", "attempt", "worker", "task_id", "message", "level")} == {
        "job_id": "job_0123456789abcdef", "shard": 3, "attempt": 2, "worker": "celery@box:42", "task_id": "t-1",
        "message": "lease renewed", "level": "WARNING"}
    assert "job_id" not in other and other["worker"].endswith(f":{__import__('os').getpid()}")


def test_a_bad_log_format_is_refused(runner, tmp_path):
    from jobs.settings import Settings

    result = runner.invoke(main, ["worker", "--log-format", "xml"])
    assert result.exit_code == 2 and "'xml' is not one of 'text', 'json'" in result.output
    done = subprocess.run([sys.executable, "-m", "cli", "worker"], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PIPELINE_LOG_FORMAT": "xml",
                               "PIPELINE_DATA_DIR": str(tmp_path)}, cwd=REPO, timeout=60)
    assert done.returncode == 2 and "'xml' is not one of" in done.stderr, done.stderr
    with pytest.raises(ValueError, match="PIPELINE_LOG_FORMAT"):   # `celery -A workers.app` reads it so
        Settings.from_env({"PIPELINE_LOG_FORMAT": "xml"})
