"""`pipeline worker --gpus` and `pipeline run --gpus` on a CPU machine: two fake GPUs (`--gpus
0,1` with --device cpu), whose children run on the CPU pinned by CUDA_VISIBLE_DEVICES all the
same. Real processes: the supervisor, its Celery worker children on real Redis, the ledger, the
tiny model. Tests that race a kill or a signal against a shard hold it mid-generation
(tests/hold.py: the children are this same command line, so they run under the hold too)."""
from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import pytest

from cluster import LEASE_S, WAIT_S, long_rows, write_jsonl
from jobs.ledger import list_jobs
from jobs.paths import JobPaths
from jobs.results.parquet_files import read_results
from jobs.settings import Settings
from metrics_helpers import NOT_UP_YET, scrape, value
from pipeline.engine_key import engine_key
from polling import wait_until
from workers.broker import live_workers

HOST = socket.gethostname()


def children(proc) -> list[int]:
    """The supervisor's child processes (its workers), by pid."""
    try:
        return [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def environ(pid: int) -> dict[str, str]:
    """A process's environment ({} once it has exited: a zombie's is gone)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except (FileNotFoundError, ProcessLookupError):
        return {}
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def pinned(proc, count: int = 2) -> dict[str, int]:
    """Each child's CUDA_VISIBLE_DEVICES -> its pid, once the supervisor has `count` live ones."""
    def live() -> dict[str, int] | None:
        found = {environ(pid).get("CUDA_VISIBLE_DEVICES"): pid for pid in children(proc)}
        return len(found) == count and None not in found and found
    return wait_until(f"{count} children of the supervisor", live)


def holding(c, sup, job_id: str, pids) -> dict[int, list] | None:
    """Each child's two running shards, by pid, once every child (pids) runs two and both hold
    their batch mid-generation (tests/hold.py says so in the supervisor's log: the children's
    output is its own); else None."""
    by_pid: dict[int, list] = {}
    for sh in c.shards(job_id):
        if sh.status == "running":
            by_pid.setdefault(int(sh.worker.rsplit(":", 1)[1]), []).append(sh)
    if c.log(sup).count("held: held-") == len(pids) and set(by_pid) == set(pids) \
            and all(len(shards) == 2 for shards in by_pid.values()):
        return by_pid
    return None


def two_free_ports() -> int:
    """A port p with p + 1 also free (GPU N's child serves base + N)."""
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            base = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
            return base
    pytest.fail("no two consecutive free ports")


def test_each_child_is_pinned_named_and_serves_its_own_metrics(sqlite_url, cluster_factory):
    c = cluster_factory(sqlite_url)
    port = two_free_ports()
    sup = c.start_worker(args=["--gpus", "0,1", "--metrics-port", str(port)])
    by_device = pinned(sup)
    assert sorted(by_device) == ["0", "1"]   # each its own GPU, as CUDA would read it
    nodes = [f"celery@{HOST}-gpu0", f"celery@{HOST}-gpu1"]
    settings = Settings.from_env(c.env)
    key = engine_key(c.engine_options)
    c.wait_for("both children announced in Redis", lambda: live_workers(settings, key) == nodes)
    for gpu, node in enumerate(nodes):   # GPU N's port is base + N, its series labelled with its node
        loads = lambda: value(scrape(port + gpu), "pipeline_engine_loads_total", worker=node)  # noqa: E731
        assert wait_until(f"{node}'s engine loaded, on port {port + gpu}", loads, retry=NOT_UP_YET) == 1
    # The supervisor computes nothing: it never loaded torch (so never CUDA)
    assert "libtorch" not in Path(f"/proc/{sup.pid}/maps").read_text()
    # and the job runs on them, each id once
    rows = [{"id": f"r{i}", "prompt": f"Item {i}", "max_tokens": 4} for i in range(8)]
    job_id = c.submit(rows, shard_size=2)
    assert c.wait_until_ended(job_id).status == "completed"
    c.assert_exactly_once(job_id, [r["id"] for r in rows])
    assert {sh.worker.rsplit(":", 1)[0] for sh in c.shards(job_id)} <= set(nodes)
    sup.send_signal(signal.SIGTERM)
    assert sup.wait(timeout=WAIT_S) == 0, c.log(sup)
    assert not children(sup)


def test_a_killed_child_is_restarted_and_the_job_completes_exactly_once(sqlite_url, cluster_factory):
    """Both children hold two shards each mid-generation (tests/hold.py); one is SIGKILLed: the
    supervisor starts it again on the same GPU, the reaper re-enqueues its shards once their
    lease expires, and every id is answered exactly once."""
    c = cluster_factory(sqlite_url, PIPELINE_SHARDS_IN_FLIGHT=2)
    sup = c.start_worker(args=["--gpus", "0,1"], held=True)
    before = pinned(sup)
    rows = long_rows("held-", 12, 64)   # four shards for the two children's four slots
    job_id = c.submit(rows, shard_size=3)
    running = c.wait_for("both children holding two shards each", lambda: holding(c, sup, job_id, set(before.values())))
    pid, victims = next(iter(running.items()))
    device = next(d for d, p in before.items() if p == pid)
    assert pid in children(sup)
    os.kill(pid, signal.SIGKILL)
    after = c.wait_for("the killed child started again", lambda: (now := pinned(sup)).get(device) not in (None, pid)
                       and now)
    assert after[device] != pid and sorted(after) == ["0", "1"]
    c.release()
    job = c.wait_until_ended(job_id, timeout=WAIT_S + 4 * LEASE_S)
    assert job.status == "completed" and job.completed_requests == len(rows)
    c.assert_exactly_once(job_id, [r["id"] for r in rows])
    for victim in victims:   # the killed attempt was reaped, the shard committed by a later one
        redone = c.shards(job_id)[victim.index]
        assert redone.status == "completed" and redone.attempt > victim.attempt
    assert f"gpu{device} died (killed by SIGKILL); restarting it in 1 s" in c.log(sup)
    assert sup.poll() is None


def test_sigterm_drains_every_child_and_the_supervisor_exits_0(sqlite_url, cluster_factory):
    """Every child holds shards mid-generation; one SIGTERM to the supervisor: each child
    releases its shards at the next step (queued again, their attempt given back) and exits 0,
    and so does the supervisor."""
    c = cluster_factory(sqlite_url, PIPELINE_SHARDS_IN_FLIGHT=2)
    sup = c.start_worker(args=["--gpus", "0,1"], held=True)
    pids = set(pinned(sup).values())
    job_id = c.submit(long_rows("held-", 12, 64), shard_size=3)
    by_child = c.wait_for("both children holding two shards each", lambda: holding(c, sup, job_id, pids))
    running = [sh for shards in by_child.values() for sh in shards]
    sup.send_signal(signal.SIGTERM)
    assert sup.wait(timeout=WAIT_S) == 0, c.log(sup)
    assert not children(sup)
    for shard in running:   # released at the next step: queued again with its attempt given back
        now = c.shards(job_id)[shard.index]
        assert (now.status, now.releases, now.attempt - now.releases) == ("queued", 1, shard.attempt - 1)
    log = c.log(sup)
    assert log.count("exited (exit 0)") == 2 and "SIGTERM received: stopping every child" in log


# ---- pipeline run --gpus --------------------------------------------------------------------------

def _run_on_two(c, tmp_path, rows):
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    run = c.start_cli("run", src, "--gpus", "0,1", "--model", c.model_dir, "--device", "cpu", "--kv-cache-gib",
                      "0.05", "--shard-size", "2", "--shards-in-flight", "1", held=True)
    job_id = c.wait_for("the job made", lambda: (jobs := get_jobs_of(c)) and jobs[0])

    def held_by_both():
        shards = c.shards(job_id)
        busy = {sh.worker for sh in shards if sh.status == "running"}
        return len(busy) == 2 and busy
    # one shard in flight each: the child holding one shard leaves the other to its sibling
    workers = c.wait_for("each child running a shard", held_by_both)
    pids = [int(w.rsplit(":", 1)[1]) for w in workers]
    assert sorted(environ(pid)["CUDA_VISIBLE_DEVICES"] for pid in pids) == ["0", "1"]
    return run, job_id, pids


def get_jobs_of(c):
    with c.Session() as s:
        return [job.id for job in list_jobs(s)]


def test_run_gpus_shares_the_job_between_one_process_per_gpu(sqlite_url, cluster_factory, tmp_path):
    c = cluster_factory(sqlite_url)
    rows = long_rows("held-", 4, 16)
    run, job_id, pids = _run_on_two(c, tmp_path, rows)
    c.release()
    assert run.wait(timeout=WAIT_S) == 0, c.log(run)
    c.assert_exactly_once(job_id, [r["id"] for r in rows])
    assert {int(sh.worker.rsplit(":", 1)[1]) for sh in c.shards(job_id)} == set(pids)   # both computed
    assert f"job {job_id}: completed" in c.log(run)


def test_run_gpus_sigterm_cancels_the_job_keeping_what_finished(sqlite_url, cluster_factory, tmp_path):
    c = cluster_factory(sqlite_url)
    rows = long_rows("held-", 4, 16)
    run, job_id, _ = _run_on_two(c, tmp_path, rows)
    run.send_signal(signal.SIGTERM)
    assert run.wait(timeout=WAIT_S) == 143, c.log(run)
    job = c.job(job_id)
    assert job.status == "cancelled" and "terminated (SIGTERM)" in c.log(run)
    table = read_results(JobPaths(c.root, job_id).results_dir)   # each id once: the held ones cancelled
    assert sorted(table["id"].to_pylist()) == [r["id"] for r in rows]
    assert "cancelled" in table["finish_reason"].to_pylist()


def test_run_gpus_runs_a_job_of_several_models_each_line_on_its_model(sqlite_url, cluster_factory, tmp_path,
                                                                      other_tiny_model_dir):
    """`pipeline run --gpus 0,1 --model A --model B`: each child takes one model's shards, then the
    other's (as `pipeline resume` of a several-model job does), each row made by its line's model."""
    c = cluster_factory(sqlite_url)
    models = [str(c.model_dir), str(other_tiny_model_dir)]
    rows = [{"id": f"r{i}", "model": models[i % 2], "prompt": f"Count {i}", "max_tokens": 3, "temperature": 0}
            for i in range(8)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    run = c.start_cli("run", src, "--gpus", "0,1", "--model", models[0], "--model", models[1], "--device", "cpu",
                      "--kv-cache-gib", "0.05", "--shard-size", "2", "--shards-in-flight", "1")
    assert run.wait(timeout=WAIT_S) == 0, c.log(run)
    (job_id,) = get_jobs_of(c)
    c.assert_exactly_once(job_id, [r["id"] for r in rows])
    job = c.job(job_id)
    fingerprints = [m["engine_fingerprint"] for m in job.models]
    table = read_results(JobPaths(c.root, job_id).results_dir)
    for row_id, engine in zip(table["id"].to_pylist(), table["engine"].to_pylist()):
        assert engine == fingerprints[int(row_id[1:]) % 2], (row_id, engine)
    assert [m["completed_requests"] for m in job.models] == [4, 4] and job.status == "completed"


def test_resume_gpus_finishes_a_queued_job_in_one_process_per_gpu(sqlite_url, cluster_factory, tmp_path):
    """`pipeline resume JOB --gpus 0,1` (here CPU engines, pinned by number) splits what is left
    of a job as `pipeline run --gpus` does: both children compute, each id once."""
    c = cluster_factory(sqlite_url)
    rows = long_rows("held-", 4, 16)
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    job_id = c.cli("submit", src, "--model", c.model_dir, "--device", "cpu", "--kv-cache-gib", "0.05",
                   "--shard-size", "2").stdout.strip()   # queued: no worker consumes its queue
    resume = c.start_cli("resume", job_id, "--gpus", "0,1", "--shards-in-flight", "1", held=True)
    busy = c.wait_for("each child running a shard",
                      lambda: len({sh.worker for sh in c.shards(job_id) if sh.status == "running"}) == 2)
    assert busy
    c.release()
    assert resume.wait(timeout=WAIT_S) == 0, c.log(resume)
    c.assert_exactly_once(job_id, [r["id"] for r in rows])
    assert len({sh.worker for sh in c.shards(job_id)}) == 2   # both computed


def test_retry_gpus_needs_local(sqlite_url, cluster_factory):
    c = cluster_factory(sqlite_url)
    done = c.cli("retry", "job_0123456789abcdef", "--gpus", "2")
    assert done.returncode == 2 and "--gpus splits a job run here: give it with --local" in done.stderr, done.stderr
