"""Helpers of the monitoring tests (tests/end_to_end/test_monitoring.py, test_metrics_counting.py):
a /metrics endpoint scraped and parsed, what a worker's counters must say after a job, a real
Prometheus server, and rows whose prompts share a cached prefix."""
from __future__ import annotations

import base64
import contextlib
import json
import shutil
import socket
import subprocess
import urllib.parse
import urllib.request
import uuid
from collections import Counter
from pathlib import Path

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from cluster import TOO_LONG_FOR_TINY, write_jsonl
from polling import wait_until

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

# What a server still starting (or a series not written yet) raises: polled again.
NOT_UP_YET = (OSError, ValueError, KeyError)


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
# Counted only where measured: no series at all where no energy counter is readable or no rate given.
UNMEASURED_MAY_BE_ABSENT = {"pipeline_energy_joules", "pipeline_cost"}


def check_worker_families(port: int) -> None:
    """The worker's endpoint has every metric of the issue with its type, and its series carry
    only low-cardinality labels (never a job or request id)."""
    families = {f.name: f for f in text_string_to_metric_families(get(f"http://127.0.0.1:{port}/metrics").decode())}
    assert {name: families[name].type for name in WORKER_METRICS if name in families} == WORKER_METRICS
    for family in families.values():
        if family.name.startswith("pipeline_"):
            # each was written to, so each is there to query
            assert family.samples or family.name in UNMEASURED_MAY_BE_ABSENT, family.name
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
        wait_until("Prometheus to be ready", lambda: get(f"http://127.0.0.1:{port}/-/ready"), timeout=60,
                   poll_s=0.5, retry=NOT_UP_YET)
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
