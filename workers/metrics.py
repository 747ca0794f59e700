"""Prometheus metrics of a worker process (and of `pipeline run`), with prometheus_client.

What is counted, and when:
* requests, tokens, time to first token and latency: when a shard's results are committed
  to the ledger (count_results), from the rows committed, so that summed over every process
  they equal the ledger and the Parquet results; an attempt that commits nothing (lost,
  released, crashed) counts nothing;
* energy, device-seconds and cost: what each shard was charged (workers.energy), when it
  commits, as the results;
* shards: each run_shard call by its outcome (runs_shards), "crashed" for one that raised
  (it is retried), and the shards the reaper gives up on (count_given_up_shard);
* the engine: between the steps of its loop (EngineObserver): step time, running and waiting
  sequences, KV-cache use, preemptions.

Labels are model and worker only: job and request ids are in the ledger and the logs.

One process (threads or solo pool, `pipeline run`): `serve` starts prometheus_client's HTTP
server on the default registry. Prefork (`pipeline worker --concurrency N`): every process
writes its values to files in PROMETHEUS_MULTIPROC_DIR (the library's multiprocess mode,
chosen when prometheus_client is first imported, so the worker command sets it before
anything imports this module), and the parent's endpoint adds them up. One worker per GPU
(`pipeline worker --gpus`, workers/supervisor.py): each GPU's worker is a process of its own,
serving its own endpoint on the base port + its GPU's number, its series labelled with its
node name (worker="<node>-gpu<N>"); nothing is shared between them, and the supervisor serves none.
"""
from __future__ import annotations

import collections
import functools
import glob
import logging
import os
import socket
from pathlib import Path

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, multiprocess, start_http_server
from prometheus_client import values as _values

from jobs.results.result_row import SUMMED_COLUMNS, shard_totals
from pipeline.models.bundled import BUNDLED_NAME

log = logging.getLogger(__name__)

LABELS = ("model", "worker")
# Seconds; a request's times include its wait for a place in the batch (a big shard's last
# requests wait minutes on a CPU).
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1800)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

PROMPT_TOKENS = Counter("pipeline_prompt_tokens", "Prompt tokens of the requests committed.", LABELS)
GENERATED_TOKENS = Counter("pipeline_generated_tokens", "Output tokens of the requests committed.", LABELS)
CACHED_PROMPT_TOKENS = Counter("pipeline_cached_prompt_tokens",
                               "Prompt tokens of the requests committed that the prefix cache served.", LABELS)
DRAFT_TOKENS = Counter("pipeline_draft_tokens", "Speculative tokens drafted for the requests committed.", LABELS)
ACCEPTED_TOKENS = Counter("pipeline_accepted_tokens",
                          "Speculative tokens of the requests committed that verification accepted.", LABELS)
# One counter per summed result column (jobs.results.result_row.SUMMED_COLUMNS), added to per commit:
# those above under their own names, a newer column as pipeline_<column> (nothing to add here).
TOKEN_COUNTERS = {"prompt_tokens": PROMPT_TOKENS, "output_tokens": GENERATED_TOKENS,
                  "cached_tokens": CACHED_PROMPT_TOKENS, "draft_tokens": DRAFT_TOKENS,
                  "accepted_tokens": ACCEPTED_TOKENS}
TOKEN_COUNTERS.update({name: Counter(f"pipeline_{name}", f"{name} of the requests committed (a summed result "
                                     "column).", LABELS) for name in SUMMED_COLUMNS if name not in TOKEN_COUNTERS})
REQUESTS = Counter("pipeline_requests", "Requests committed, by finish reason.", (*LABELS, "finish_reason"))
# What the shards committed were charged (workers.energy): each worker's busy time, split between its shards.
ENERGY = Counter("pipeline_energy_joules", "Joules the device's energy counter (NVML, RAPL) counted for the shards "
                 "committed (none where it is not readable).", LABELS)
DEVICE_SECONDS = Counter("pipeline_device_seconds", "Device-seconds charged to the shards committed.", LABELS)
COST = Counter("pipeline_cost", "Cost charged to the shards committed: device-seconds at the worker's "
               "--cost-per-hour (none without a rate).", LABELS)
SHARDS = Counter("pipeline_shards", "Shard runs by outcome (committed ones: completed, cancelled, failed).",
                 ("worker", "outcome"))
PREEMPTIONS = Counter("pipeline_preemptions", "Sequences preempted (recomputed later) for lack of KV blocks.",
                      LABELS)
ENGINE_LOADS = Counter("pipeline_engine_loads", "Engines (model and KV cache) built by a worker process.", LABELS)
RUNNING = Gauge("pipeline_running_sequences", "Sequences in the engine's batch.", LABELS,
                multiprocess_mode="livesum")
WAITING = Gauge("pipeline_waiting_sequences", "Sequences waiting for a place in the engine's batch.", LABELS,
                multiprocess_mode="livesum")
# Prefork: the fullest engine of the worker's processes.
KV_CACHE = Gauge("pipeline_kv_cache_utilization", "Share of the KV-cache blocks held by sequences (0..1).",
                 LABELS, multiprocess_mode="livemax")
SHARDS_IN_FLIGHT = Gauge("pipeline_shards_in_flight", "Shards being run (claimed, generating, committing).",
                         ("worker",), multiprocess_mode="livesum")
TIME_TO_FIRST_TOKEN = Histogram("pipeline_time_to_first_token_seconds",
                                "From a request entering the engine to its first token (committed requests "
                                "that produced tokens).", LABELS, buckets=REQUEST_BUCKETS)
REQUEST_LATENCY = Histogram("pipeline_request_latency_seconds",
                            "From a request entering the engine to its end (committed requests that produced "
                            "tokens).", LABELS, buckets=REQUEST_BUCKETS)
ENGINE_STEP = Histogram("pipeline_engine_step_seconds", "One engine step (schedule, model, sample).", LABELS,
                        buckets=STEP_BUCKETS)

_worker = socket.gethostname()   # the worker label: the Celery node name in a worker (set_worker)
_server = None


def set_worker(name: str) -> None:
    """The `worker` label of this process's series (a Celery worker: its node name)."""
    global _worker
    _worker = name


def model_label(model: str | None) -> str:
    """A job's or an engine's model as a label: a directory's name, not its whole path."""
    return Path(model).name if model else BUNDLED_NAME


# ---- what the shards did -------------------------------------------------------------------

def count_results(rows: list[dict], model: str | None, totals: dict[str, int] | None = None) -> None:
    """A shard's result rows, just committed to the ledger (totals: their shard_totals, if made)."""
    labels = (model_label(model), _worker)
    if totals is None:
        totals = shard_totals(rows)
    for name, counter in TOKEN_COUNTERS.items():
        counter.labels(*labels).inc(totals[name])
    # Each series looked up once a shard, not once a row (a labels() call takes a lock and a lookup).
    for reason, count in collections.Counter(str(row["finish_reason"]) for row in rows).items():
        REQUESTS.labels(*labels, reason).inc(count)
    # Rows that ran and produced tokens (not an error, not cancelled unstarted); none: no series made.
    timed = [(row["ttft_s"], row["latency_s"]) for row in rows if row["ttft_s"] is not None]
    if timed:
        ttft, latency = TIME_TO_FIRST_TOKEN.labels(*labels), REQUEST_LATENCY.labels(*labels)
        for ttft_s, latency_s in timed:
            ttft.observe(ttft_s)
            latency.observe(latency_s)


def count_usage(usage, model: str | None) -> None:
    """What a shard just committed was charged (a workers.energy.Usage; None: nothing)."""
    if usage is None:
        return
    labels = (model_label(model), _worker)
    DEVICE_SECONDS.labels(*labels).inc(usage.device_seconds)
    if usage.joules is not None:
        ENERGY.labels(*labels).inc(max(usage.joules, 0.0))
    if usage.cost is not None:
        COST.labels(*labels).inc(usage.cost)


def count_engine_load(model: str | None) -> None:
    """An engine was built in this process (a worker builds one per engine it serves)."""
    ENGINE_LOADS.labels(model_label(model), _worker).inc()


def count_given_up_shard(model: str | None, num_error_rows: int) -> None:
    """A shard the reaper committed as failed (its workers kept dying), with its error rows."""
    SHARDS.labels(_worker, "failed").inc()
    if num_error_rows:
        REQUESTS.labels(model_label(model), _worker, "error").inc(num_error_rows)


def runs_shards(run_shard):
    """Decorate run_shard: a shard in flight while it runs, and its outcome once it ends
    ("crashed" when it raised: the shard stays leased and is retried)."""
    @functools.wraps(run_shard)
    def wrapper(*args, **kwargs):
        in_flight = SHARDS_IN_FLIGHT.labels(_worker)
        in_flight.inc()
        outcome = "crashed"
        try:
            result = run_shard(*args, **kwargs)
            outcome = str(result)
            return result
        finally:
            in_flight.dec()
            SHARDS.labels(_worker, outcome).inc()
    return wrapper


# ---- the engine ----------------------------------------------------------------------------

class EngineObserver:
    """EngineLoop's observer: called in the loop thread between steps, where nothing else
    touches the engine, with the last step's seconds (None when the loop only took requests
    in or out). It must never break the loop, so it logs and goes on."""

    def __init__(self):
        self._series = None      # the engine's labelled series, made on the first call
        self._preemptions = 0    # the engine's count at the last call
        self._failed = False

    def __call__(self, engine, step_s: float | None) -> None:
        try:
            if self._series is None:
                labels = (model_label(engine.config.model), _worker)
                self._series = tuple(m.labels(*labels) for m in (ENGINE_STEP, RUNNING, WAITING, KV_CACHE,
                                                                 PREEMPTIONS))
            step, running, waiting, kv_cache, preemptions = self._series
            if step_s is not None:
                step.observe(step_s)
            scheduler = engine.scheduler
            running.set(len(scheduler.running))
            waiting.set(len(scheduler.waiting))
            if engine.block_manager is not None:   # an encoder has no KV cache
                kv_cache.set(engine.block_manager.utilization)
            if scheduler.num_preemptions > self._preemptions:
                preemptions.inc(scheduler.num_preemptions - self._preemptions)
                self._preemptions = scheduler.num_preemptions
        except Exception:
            if not self._failed:   # once: a broken metric must not flood the log either
                log.exception("recording the engine's metrics failed")
                self._failed = True


# ---- the endpoint --------------------------------------------------------------------------

def serve(port: int, *, addr: str = "0.0.0.0") -> None:
    """Serve /metrics on port (once per process): the default registry, or in multiprocess
    mode the sum of every process's values. OSError if the port is taken."""
    global _server
    if _server is not None:
        return
    if is_multiprocess():
        registry = CollectorRegistry()
        _LiveProcessesCollector(registry)
    else:
        registry = REGISTRY
    _server, _ = start_http_server(port, addr=addr, registry=registry)
    log.info("metrics at http://%s:%d/metrics%s", addr, port, " (multiprocess)" if is_multiprocess() else "")


def stop_serving() -> None:
    global _server
    if _server is not None:
        _server.shutdown()
        _server.server_close()
        _server = None


def is_multiprocess() -> bool:
    return _values.ValueClass is not _values.MutexValue


class _LiveProcessesCollector(multiprocess.MultiProcessCollector):
    """The multiprocess collector, minus the gauges of processes that are gone.

    A pool child that exits normally removes its own (worker_process_shutdown); one that
    was killed cannot, so each scrape drops the live-gauge files of pids no longer alive."""

    def collect(self):
        for path in glob.glob(os.path.join(self._path, "gauge_live*_*.db")):
            pid = path.rsplit("_", 1)[1][:-3]
            if pid.isdigit() and not _alive(int(pid)):
                multiprocess.mark_process_dead(int(pid), self._path)
        return super().collect()


def mark_process_dead(pid: int) -> None:
    """A prefork child is exiting: its live gauges (sequences, shards in flight) go with it."""
    if is_multiprocess():
        multiprocess.mark_process_dead(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
