"""Monitoring with real parts: a real worker's /metrics against the ledger and the Parquet
results, a real Prometheus (Debian's package) scraping a worker and `pipeline metrics`,
real Flower listing the shard tasks, a prefork worker's one endpoint for all its children,
and JSON logs. What run_shard, the engine loop, the reaper and the exporter count, in
process: test_metrics_counting.py."""
from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import threading
import urllib.error
import uuid

import pytest

from cli import main
from dashboards import dashboard_queries
from cluster import REPO
from metrics_helpers import (
    NOT_UP_YET, check_worker_counters, check_worker_families, free_port, get, json_log_of, prometheus, query_value,
    scrape, settled, some_rows, submit_and_wait, value,
)
from polling import wait_until
from workers import logs
from workers.shard_runner import ShardOutcome


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
                             poll_s=0.5, retry=NOT_UP_YET, diagnostics=c.all_logs)
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
                   == job.output_tokens, timeout=60, poll_s=0.5, retry=NOT_UP_YET)
        (series,) = query("pipeline_generated_tokens_total")
        assert series["metric"]["job"] == "pipeline-workers" and "worker" in series["metric"]
        assert query_value(query, 'sum(pipeline_requests_total{finish_reason="error"})') == 1
        wait_until("Prometheus to store the ledger's view",
                   lambda: query_value(query, 'pipeline_jobs{status="completed"}') == 1, timeout=60, poll_s=0.5,
                   retry=NOT_UP_YET)
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
               poll_s=0.5, retry=NOT_UP_YET, diagnostics=c.all_logs)
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
                            poll_s=0.5, retry=NOT_UP_YET, diagnostics=c.all_logs)
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
    samples = wait_until("the counters of both children", lambda: settled(port, 4), poll_s=0.5, retry=NOT_UP_YET,
                         diagnostics=c.all_logs)
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
    samples = wait_until("the solo worker's endpoint", lambda: scrape(solo_port), timeout=60, poll_s=0.5,
                         retry=NOT_UP_YET, diagnostics=c.all_logs)
    assert any(s.name == "process_cpu_seconds_total" for s in samples)
    wait_until("the prefork worker's refusal", lambda: "needs PROMETHEUS_MULTIPROC_DIR" in c.log(prefork),
               timeout=60, poll_s=0.5, retry=NOT_UP_YET, diagnostics=c.all_logs)
    with pytest.raises(OSError):
        scrape(prefork_port)

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
