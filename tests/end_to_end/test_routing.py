"""Jobs go to the workers that hold their model: one queue per engine key, real Redis, real
workers (`pipeline worker --model DIR`), real `pipeline submit` and `status` processes."""
from __future__ import annotations

import json
import signal

import pytest

from pipeline.engine_key import engine_key
from cluster import FAST, Cluster, long_rows, write_jsonl

FAST_ARGS = ["--kv-cache-gib", str(FAST["kv_cache_gib"]), "--device", FAST["device"]]


def worker_for(c: Cluster, model_dir, held: bool = False, **env):
    """A `pipeline worker --model DIR` of the cluster (its engine options on the command line)."""
    return c.start_worker(args=["--model", str(model_dir), *FAST_ARGS], held=held, PIPELINE_WORKER_ENGINES="", **env)


def submit(c: Cluster, tmp_path, rows, model_dir, *args):
    src = write_jsonl(tmp_path / f"in-{rows[0]['id']}.jsonl", rows)
    done = c.cli("submit", str(src), "--model", str(model_dir), *FAST_ARGS, *args)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip(), done.stderr


def loads(c: Cluster, proc) -> int:
    return c.log(proc).count("loading engine ")


def wait_served(c: Cluster, proc, model_dir) -> None:
    key = engine_key({"model": str(model_dir)})
    c.wait_for(f"the worker to load {model_dir.name}",
               lambda: f"engine {key} loaded" in c.log(proc), timeout=120)


def test_two_models_two_workers_each_job_runs_only_on_its_models_worker(
        sqlite_url, cluster_factory, tmp_path, tiny_model_dir, other_tiny_model_dir):
    c = cluster_factory(sqlite_url)
    a_worker, b_worker = worker_for(c, tiny_model_dir), worker_for(c, other_tiny_model_dir)
    for proc, model in ((a_worker, tiny_model_dir), (b_worker, other_tiny_model_dir)):
        wait_served(c, proc, model)   # loaded at start-up, before any shard
    a_jobs, b_jobs = [], []
    for i in range(2):   # interleaved: a, b, a, b
        a_jobs.append(submit(c, tmp_path, long_rows(f"a{i}-", 6, 6), tiny_model_dir, "--shard-size", "2")[0])
        b_jobs.append(submit(c, tmp_path, long_rows(f"b{i}-", 6, 6), other_tiny_model_dir, "--shard-size", "2")[0])
    for job_id in a_jobs + b_jobs:
        assert c.wait_until_ended(job_id).status == "completed"
    pid = {a_worker.pid: "a", b_worker.pid: "b"}
    for side, jobs in (("a", a_jobs), ("b", b_jobs)):
        for job_id in jobs:
            assert c.job(job_id).engine_key == engine_key({"model": str(
                tiny_model_dir if side == "a" else other_tiny_model_dir)})
            assert {pid[int(sh.worker.rsplit(":", 1)[1])] for sh in c.shards(job_id)} == {side}
    assert loads(c, a_worker) == loads(c, b_worker) == 1   # each loaded its engine once, never the other's


def test_a_job_no_worker_serves_waits_with_a_warning_until_one_starts(
        sqlite_url, cluster_factory, tmp_path, tiny_model_dir, other_tiny_model_dir):
    c = cluster_factory(sqlite_url)
    a_worker = worker_for(c, tiny_model_dir)
    wait_served(c, a_worker, tiny_model_dir)
    rows = long_rows("orphan-", 4, 4)
    job_id, warning = submit(c, tmp_path, rows, other_tiny_model_dir, "--shard-size", "2")
    key = engine_key({"model": str(other_tiny_model_dir)})
    assert f"no live worker serves engine {key}" in warning
    hint = next(line.strip() for line in warning.splitlines() if line.strip().startswith("pipeline worker"))
    assert hint == f"pipeline worker --model {other_tiny_model_dir}"   # only the options that pick the engine
    status = c.cli("status", job_id)
    assert status.returncode == 0 and "waiting for a worker of its engine" in status.stdout, status.stdout
    assert key in status.stdout and "pipeline worker --model" in status.stdout
    assert "(no worker)" in c.cli("list").stdout
    assert c.job(job_id).status == "queued" and job_id not in c.log(a_worker)   # the other model's worker never took it

    b_worker = worker_for(c, other_tiny_model_dir)
    assert c.wait_until_ended(job_id).status == "completed"
    c.assert_exactly_once(job_id, [r["id"] for r in rows])
    assert {int(sh.worker.rsplit(":", 1)[1]) for sh in c.shards(job_id)} == {b_worker.pid}
    assert "waiting for a worker" not in c.cli("status", job_id).stdout


def test_a_dead_workers_shard_goes_back_to_its_models_queue(
        sqlite_url, cluster_factory, tmp_path, tiny_model_dir, other_tiny_model_dir):
    """SIGKILL mid-shard: the reaper re-enqueues the shard to its model's queue, where the
    other model's worker (idle all along) never takes it; a new worker of the model does.
    The victim holds the shard four tokens in (tests/hold.py) until the kill, one shard at a
    time (the warm one committed first), so it cannot commit first on a fast machine."""
    c = cluster_factory(sqlite_url)
    victim = worker_for(c, tiny_model_dir, held=True, PIPELINE_SHARDS_IN_FLIGHT=1)
    bystander = worker_for(c, other_tiny_model_dir)
    wait_served(c, victim, tiny_model_dir)
    rows = long_rows("warm-", 2, 4) + long_rows("held-", 2, 64)
    job_id, _ = submit(c, tmp_path, rows, tiny_model_dir, "--shard-size", "2")
    c.wait_held(victim)
    assert [sh.status for sh in c.shards(job_id)] == ["completed", "running"]
    victim.send_signal(signal.SIGKILL)
    victim.wait(30)
    c.wait_for("the reaper to re-enqueue the dead shard",
               lambda: "'requeued': [" in c.log(bystander) and c.shards(job_id)[1].status == "queued")
    queued = c.wait_for("its message in its model's queue",
                        lambda: _messages(c, engine_key({"model": str(tiny_model_dir)})))
    assert json.loads(queued[0])["headers"]["argsrepr"] == f"(job_id={job_id!r}, shard=1)"
    assert _messages(c, engine_key({"model": str(other_tiny_model_dir)})) == []
    successor = worker_for(c, tiny_model_dir)
    assert c.wait_until_ended(job_id).status == "completed"
    c.assert_exactly_once(job_id, [r["id"] for r in rows])
    assert c.shards(job_id)[1].worker.rsplit(":", 1)[1] == str(successor.pid)
    assert loads(c, bystander) == 1 and "held-" not in c.log(bystander)


def test_one_worker_serves_two_models_one_at_a_time(sqlite_url, cluster_factory, tmp_path, tiny_model_dir,
                                                     other_tiny_model_dir):
    """--model A --model B: A is loaded at start-up, B once A's queue is empty; both jobs complete."""
    c = cluster_factory(sqlite_url)
    both = c.start_worker(args=["--model", str(tiny_model_dir), "--model", str(other_tiny_model_dir), *FAST_ARGS],
                          PIPELINE_WORKER_ENGINES="")
    wait_served(c, both, tiny_model_dir)
    a_job, _ = submit(c, tmp_path, long_rows("a-", 4, 4), tiny_model_dir, "--shard-size", "2")
    b_job, warning = submit(c, tmp_path, long_rows("b-", 4, 4), other_tiny_model_dir, "--shard-size", "2")
    assert "no live worker" not in warning   # it says it serves both
    for job_id in (a_job, b_job):
        assert c.wait_until_ended(job_id).status == "completed"
    log = c.log(both)
    keys = [engine_key({"model": str(m)}) for m in (tiny_model_dir, other_tiny_model_dir)]
    assert [line.split("loading engine ")[1].split()[0] for line in log.splitlines() if "loading engine " in line] \
        == keys   # A, then B once: never back and forth


def _messages(c: Cluster, key: str) -> list[bytes]:
    """The messages waiting in an engine's queue, every priority's list."""
    import redis

    from workers.broker import priority_lists
    client = redis.Redis.from_url(c.broker_url)
    return [m for name in priority_lists(f"{c.queue}.{key}") for m in client.lrange(name, 0, -1)]


@pytest.mark.parametrize("options", [{}, {"dtype": "float32"}, {"quantization": "int8"}])
def test_the_engine_key_names_the_model_and_changes_only_with_what_changes_answers(options, tiny_model_dir):
    base = {"model": str(tiny_model_dir)}
    key = engine_key({**base, **options})
    assert key.startswith(f"{tiny_model_dir.name.lower()}-") and len(key.rsplit("-", 1)[1]) == 8
    worker_own = {**FAST, "max_num_seqs": 7, "admission_group": 3}   # where and how a worker runs
    assert key == engine_key({**base, **options, **worker_own})
    assert (key == engine_key(base)) == (not options)
    assert engine_key({}).startswith("smollm2-135m-instruct-")
