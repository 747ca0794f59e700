"""What the metrics count, in process: run_shard counts only what it commits, the reaper the
shards it gives up, the engine observer every step and preemption, the ledger-and-broker
exporter its queues and jobs (on both ledgers), a prefork worker's children added up, and
`pipeline run --metrics-port` serving its numbers while it runs."""
from __future__ import annotations

import socket
import subprocess
import sys
import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families

from jobs.ledger import claim_shard, get_job, make_engine, request_cancel, session_factory
from jobs.submission import create_job_from_file
from pipeline import Engine, EngineConfig, Request
from cli import main
from pipeline.engine_key import engine_key
from pipeline.engine.engine_loop import EngineLoop
from engine_helpers import greedy, random_prompt
from ledger_helpers import job_of_a_dead_worker
from cluster import REPO, write_jsonl
from metrics_helpers import HOST, NOT_UP_YET, free_port, in_process, scrape, some_rows, value
from polling import wait_until
from shard_helpers import another_worker_takes_over, cancel, run_with_a_quick_request_first, submit
from worker_process import BROKER_URL, drop_queue
from workers import metrics
from workers.shard_runner import run_shard


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


def test_a_shard_of_only_errors_counts_them_and_makes_no_timing_series():
    """count_results on a shard whose rows never produced a token: its requests are counted by
    finish reason, and no time-to-first-token or latency series appears for a model that has
    none (an empty series would read as a model that answered nothing)."""
    from jobs.results.result_row import error_rows
    from jobs.input.request_spec import RequestSpec

    model = f"/models/errors-only-{uuid.uuid4().hex[:8]}"
    label = metrics.model_label(model)
    specs = [RequestSpec(id=f"e{i}", line=i + 1, prompt="Hi", messages=None) for i in range(3)]
    metrics.count_results(error_rows(specs, "boom", 0, 1), model)
    assert in_process("pipeline_requests_total", model=label, worker=HOST, finish_reason="error") == 3
    for name in ("pipeline_time_to_first_token_seconds_count", "pipeline_request_latency_seconds_count"):
        assert metrics.REGISTRY.get_sample_value(name, {"model": label, "worker": HOST}) is None


def test_the_reaper_counts_the_shards_it_gives_up(Session, data_root, tmp_path):
    from workers.recovery import recover

    before = (in_process("pipeline_requests_total", model="tiny", worker=HOST, finish_reason="error"),
              in_process("pipeline_shards_total", worker=HOST, outcome="failed"))
    job_id = job_of_a_dead_worker(Session, data_root, tmp_path)
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
            in_process("pipeline_running_sequences", **labels) == 0), timeout=10, poll_s=0.05, retry=NOT_UP_YET)
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
