"""End to end through real Redis and a real Celery worker subprocess (`pipeline worker`),
on SQLite and PostgreSQL ledgers: `pipeline submit --wait`, then the ledger and the results."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from jobs.ledger import get_job, get_shards, make_engine, session_factory, upgrade
from jobs.paths import JobPaths, check_job_id
from jobs.results.parquet_files import read_results
from polling import wait_until
from worker_process import BROKER_URL, drop_queue, worker

REPO = Path(__file__).resolve().parents[2]
QUEUE = f"pipeline-test-{uuid.uuid4().hex[:8]}"  # this session's own queue: no stray messages cross
WAIT_S = 180


@pytest.fixture(scope="session", autouse=True)
def queue_dropped_at_end():
    yield
    drop_queue(QUEUE)


def pipeline_env(data_root, db_url) -> dict:
    return {**os.environ, "PIPELINE_DATA_DIR": str(data_root), "PIPELINE_DATABASE_URL": db_url,
            "PIPELINE_BROKER_URL": BROKER_URL, "PIPELINE_QUEUE": QUEUE}


def submit_and_wait(env, src, *args) -> str:
    """`pipeline submit --wait`; returns the job id it printed (its only stdout)."""
    done = subprocess.run([sys.executable, "-m", "cli", "submit", str(src), "--wait", *args],
                          env=env, capture_output=True, text=True, timeout=WAIT_S)
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip()
    check_job_id(job_id)  # a well-formed job id and nothing else
    return job_id


def ledger_state(db_url, job_id):
    engine = make_engine(db_url)
    try:
        with session_factory(engine)() as s:
            return get_job(s, job_id), get_shards(s, job_id)
    finally:
        engine.dispose()


def test_worker_runs_every_shard(db_url, data_root, tmp_path, tiny_model_dir):
    ids = [f"q{i:02d}" for i in range(12)]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt": f"Item {i}", "max_tokens": 4}) + "\n" for i in ids))
    env = pipeline_env(data_root, db_url)
    fast = ["--kv-cache-gib", "0.05", "--device", "cpu"]
    with worker(env, tmp_path / "worker.log", "--model", tiny_model_dir, *fast):
        job_id = submit_and_wait(env, src, "--model", str(tiny_model_dir), "--shard-size", "4", *fast)
    job, shards = ledger_state(db_url, job_id)
    assert (job.status, job.total_requests, job.completed_requests, job.failed_requests) == ("completed", 12, 12, 0)
    assert [(sh.status, sh.num_requests, sh.completed_requests) for sh in shards] == [("completed", 4, 4)] * 3
    jp = JobPaths(data_root, job_id)
    assert sorted(read_results(jp.results_dir)["id"].to_pylist()) == ids
    assert not list(jp.tmp_dir.glob("*")) and jp.stats_file.exists()


def test_bundled_model_answers_paris(data_root, tmp_path):
    db_url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    upgrade(db_url)
    src = tmp_path / "in.jsonl"
    question = [{"role": "user", "content": "What is the capital of France?"}]
    src.write_text(json.dumps({"id": "france", "messages": question, "temperature": 0, "max_tokens": 20}) + "\n")
    env = pipeline_env(data_root, db_url)
    # float32: in bfloat16 (auto on a CPU with AVX-512 BF16 or AMX) the first token is a near
    # tie for this 135M model, "The" or "L'Étoile" by CPU (float32's margin: 0.10 logits).
    with worker(env, tmp_path / "worker.log", "--dtype", "float32"):
        job_id = submit_and_wait(env, src, "--dtype", "float32")
    (row,) = read_results(JobPaths(data_root, job_id).results_dir).to_pylist()
    assert row["finish_reason"] == "stop" and "Paris" in row["output"], row
    assert ledger_state(db_url, job_id)[0].status == "completed"


def test_a_crashing_shard_is_retried_then_recorded_as_errors(data_root, tmp_path):
    """The model cannot load: each attempt crashes, Celery retries after the (short) lease,
    and the last attempt writes error rows, so the job still ends."""
    db_url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    upgrade(db_url)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"r{i}", "prompt": "Hi", "max_tokens": 2}) + "\n" for i in range(3)))
    env = {**pipeline_env(data_root, db_url), "PIPELINE_LEASE_SECONDS": "1", "PIPELINE_MAX_ATTEMPTS": "2"}
    missing = tmp_path / "broken-model"   # looks like a model directory (submit takes it), but does not load
    missing.mkdir()
    (missing / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (missing / "model.safetensors").write_bytes(b"not safetensors")
    with worker(env, tmp_path / "worker.log", "--model", missing):
        job_id = submit_and_wait(env, src, "--model", str(missing))
    job, (shard,) = ledger_state(db_url, job_id)
    assert (job.status, job.completed_requests, job.failed_requests) == ("completed", 0, 3)
    assert (shard.status, shard.attempt) == ("failed", 2)
    errors = read_results(JobPaths(data_root, job_id).results_dir)["error"].to_pylist()
    assert len(errors) == 3 and all("failed 2 times" in e for e in errors)


def test_the_app_takes_json_only_and_acks_late():
    from workers.app import app

    conf = app.conf
    assert conf.accept_content == ["json"] and conf.task_serializer == conf.result_serializer == "json"
    assert conf.task_acks_late and conf.task_reject_on_worker_lost and conf.worker_prefetch_multiplier == 1
    assert conf.broker_transport_options["visibility_timeout"] > 0 and conf.task_ignore_result


def test_the_shard_runner_imports_neither_celery_nor_torch():
    code = "import sys, workers.shard_runner; print(sorted({'celery', 'torch'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_a_worker_stopped_while_its_engine_loads_exits_0(data_root, tmp_path, tiny_model_dir):
    """SIGTERM while the engine's thread is inside the torch ops of a load: the warm shutdown
    waits for the load and closes the engine, so the process exits 0 (it aborted, SIGABRT:
    "terminate called without an active exception", 3 runs of 3 here, before the close)."""
    db_url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    upgrade(db_url)
    release = tmp_path / "release-the-build"
    env = {**pipeline_env(data_root, db_url), "TEST_BUILD_RELEASE": str(release), "PYTHONPATH": str(REPO)}
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tests.held_build", "cli", "worker", "--loglevel", "info",
                                 "--model", str(tiny_model_dir), "--kv-cache-gib", "0.05", "--device", "cpu"],
                                env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_log(proc, log_path, "building: held in torch ops")
        wait_for_log(proc, log_path, " ready.")   # Celery takes SIGTERM as a warm shutdown from here on
        proc.send_signal(signal.SIGTERM)
        # the state this waits for: the shutdown waiting for the load (or, before, the process gone)
        wait_for_log(proc, log_path, "waiting for the engine being loaded", until_exit=True)
        release.touch()
        returncode = proc.wait(timeout=WAIT_S)
    finally:
        release.touch()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = log_path.read_text(errors="replace")
    assert returncode == 0 and "terminate called" not in output, output[-3000:]
    assert "Warm shutdown" in output and "loaded in" in output   # it stopped mid-load, and waited for it


def wait_for_log(proc, log_path, line: str, until_exit: bool = False) -> None:
    """Until the worker's log holds `line` (or, until_exit, the worker has ended)."""
    def log() -> str:
        return log_path.read_text(errors="replace")

    def there() -> bool:
        if line in log():
            return True
        if proc.poll() is not None:   # ended without it: the state sought only with until_exit
            assert until_exit, log()[-3000:]
            return True
        return False

    wait_until(f"{line!r} in the worker's log", there, WAIT_S, poll_s=0.1, diagnostics=lambda: log()[-3000:])


def test_importing_the_app_sets_nothing_and_a_starting_worker_sets_its_allocators():
    """workers.app used to set ARROW_DEFAULT_MEMORY_POOL (and the malloc arenas) when imported,
    in every producer too; a worker makes them as it starts, before its task modules import
    pyarrow (Celery's own start-up: loader.import_default_modules, as `celery -A workers.app
    worker` runs it; `pipeline worker` makes them in cli.main)."""
    code = ("import os, workers.app\n"
            "print(os.environ.get('ARROW_DEFAULT_MEMORY_POOL'))\n"
            "workers.app.app.loader.import_default_modules()\n"
            "import pyarrow\n"
            "print(os.environ.get('ARROW_DEFAULT_MEMORY_POOL'), pyarrow.default_memory_pool().backend_name)\n")
    env = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.splitlines() == ["None", "system system"], done.stdout + done.stderr
