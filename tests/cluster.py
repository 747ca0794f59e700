"""A test cluster: real Celery worker subprocesses, the CLI, the ledger and Redis, and the
invariant every fault-tolerance scenario checks (each (id, choice) once, exact counts)."""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path

import pyarrow.dataset as pads
import pytest

from jobs.ledger import get_job, get_shards, make_engine, session_factory
from jobs.paths import JobPaths
from jobs.results.parquet_files import read_results
from jobs.submission import create_job_from_file
from pipeline.engine_key import engine_key
from polling import WAIT_S, wait_until
from worker_process import BROKER_URL, drop_queue
import hold


REPO = Path(__file__).resolve().parent.parent
LEASE_S = 3
FAST = {"kv_cache_gib": 0.05, "device": "cpu"}
# The tiny test model's context (conftest.TINY_LLAMA). A test that must catch a worker
# mid-shard holds it there (tests/hold.py) rather than count on a shard lasting long enough.
TINY_CONTEXT = 2048
TOO_LONG_FOR_TINY = "word " * (TINY_CONTEXT + 100)   # a prompt over the tiny model's context


def long_rows(prefix: str, n: int, max_tokens: int = 1200) -> list[dict]:
    """Requests that keep the tiny model busy for a while (no early EOS)."""
    return [{"id": f"{prefix}{i:03d}", "prompt": f"Count {i}", "max_tokens": max_tokens, "ignore_eos": True}
            for i in range(n)]


def quick_then_held(n_quick: int, n_held: int, max_tokens: int = 64) -> list[dict]:
    """Quick requests first (the first shards, which load the engine), then requests that
    tests/hold.py holds mid-generation ("held-000", ...: group "held") until the test has
    acted, so they need not be long: nothing races."""
    return long_rows("quick-", n_quick, 8) + long_rows("held-", n_held, max_tokens)


def owner(shard, procs: list[subprocess.Popen]) -> subprocess.Popen | None:
    """The worker process (a prefork pool's parent) that runs shard."""
    pid = int(shard.worker.rsplit(":", 1)[1])
    for proc in procs:
        if proc.pid == pid or str(pid) in _children(proc.pid):
            return proc
    return None


def _children(pid: int) -> list[str]:
    with contextlib.suppress(FileNotFoundError):
        return Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return []


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _python_m(module_and_args: list[str], held: bool) -> list[str]:
    """`python -m MODULE ARGS`, with held under tests/hold.py's hold."""
    return [sys.executable, "-m", *(["tests.hold"] if held else []), *module_and_args]


class Cluster:
    """One test's ledger, data root, Redis queue and worker subprocesses."""

    def __init__(self, tmp_path: Path, data_root: Path, db_url: str, model_dir: Path, broker_url: str = BROKER_URL,
                 **env):
        self.tmp_path, self.root, self.db_url, self.broker_url = tmp_path, data_root, db_url, broker_url
        self.model_dir = model_dir
        self.queue = f"pipeline-ft-{uuid.uuid4().hex[:8]}"   # PIPELINE_QUEUE: its engine queues are under it
        self.engine_options = {"model": str(model_dir), **FAST}   # the workers serve it, the jobs ask for it
        self.shard_queue = f"{self.queue}.{engine_key(self.engine_options)}"
        self.env = {**os.environ, "PIPELINE_DATA_DIR": str(data_root), "PIPELINE_DATABASE_URL": db_url,
                    "PIPELINE_BROKER_URL": broker_url, "PIPELINE_QUEUE": self.queue,
                    "PIPELINE_LEASE_SECONDS": str(LEASE_S), "PIPELINE_MAX_ATTEMPTS": "3",
                    "PIPELINE_RECOVERY_INTERVAL": "1", "PIPELINE_QUEUED_GRACE_SECONDS": "3",
                    "PIPELINE_WORKER_ENGINES": json.dumps([self.engine_options]),
                    "TEST_HOLD_DIR": str(tmp_path / "holds"),   # tests/hold.py's releases
                    "PYTHONPATH": str(REPO), **{k: str(v) for k, v in env.items()}}
        self.engine = make_engine(db_url)
        self.Session = session_factory(self.engine)
        self.procs: list[subprocess.Popen] = []
        self.logs: dict[int, Path] = {}

    # processes
    def start_worker(self, app: str | None = None, pool: str = "solo", args=(), held: bool = False,
                     **env) -> subprocess.Popen:
        """`pipeline worker ARGS`, or with app a plain `celery -A app worker`; held: with
        tests/hold.py's hold (its "held-" requests wait mid-generation for the test)."""
        name = f"w{len(self.procs)}"
        if app is None:
            cmd = ["cli", "worker", "--loglevel", "info", *args]
        else:
            cmd = ["celery", "-A", app, "worker", f"--pool={pool}", "--concurrency=1",
                   "--loglevel=info", "--without-gossip", "--without-mingle", "--without-heartbeat",
                   "-n", f"{name}-{uuid.uuid4().hex[:6]}@%h"]
        return self.start_process(name, _python_m(cmd, held), **env)

    def start_cli(self, *args, held: bool = False, **env) -> subprocess.Popen:
        """A `pipeline` command (`run`, `resume`) as a subprocess, to be signalled; its log is
        kept. held: with tests/hold.py's hold."""
        return self.start_process(f"{args[0]}{len(self.procs)}", _python_m(["cli", *args], held), **env)

    def start_process(self, name: str, cmd: list[str], **env) -> subprocess.Popen:
        """A process of this cluster (its environment, its log), stopped with the workers."""
        log_path = self.tmp_path / f"{name}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, env={**self.env, **{k: str(v) for k, v in env.items()}}, cwd=REPO,
                                    stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        self.logs[proc.pid] = log_path
        return proc

    def wait_held(self, proc: subprocess.Popen, group: str = "held") -> str:
        """The request id at which proc's engine holds `group` (tests/hold.py), once it does."""
        # (a worker's stderr goes through Celery's logging: the line has a prefix)
        pattern = re.compile(rf"held: (\S+) after \d+ tokens \(group {re.escape(group)}\)$", re.M)
        return self.wait_for(f"process {proc.pid} holding {group} mid-generation",
                             lambda: (proc.poll() is None or pytest.fail(f"it ended:\n{self.log(proc)}"))
                             and (m := pattern.search(self.log(proc))) and m[1])

    def release(self, group: str = "held") -> None:
        """End the holds of `group` in this cluster's processes, now and later."""
        hold.release(Path(self.env["TEST_HOLD_DIR"]), group)

    def log(self, proc: subprocess.Popen) -> str:
        return self.logs[proc.pid].read_text(errors="replace")

    def all_logs(self) -> str:
        return "\n".join(f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}" for path in self.logs.values())

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        drop_queue(self.queue, self.broker_url)
        self.engine.dispose()

    # jobs
    def create_job(self, rows: list[dict], shard_size: int) -> str:
        src = write_jsonl(self.tmp_path / f"in-{uuid.uuid4().hex[:6]}.jsonl", rows)
        job_id, _ = create_job_from_file(self.Session, self.root, src, model=str(self.model_dir),
                                         engine_options=self.engine_options,
                                         shard_size=shard_size)
        return job_id

    def enqueue(self, job_id: str, indexes) -> None:
        from workers.app import app
        from workers.tasks import run_shard_task

        with app.connection_for_write(self.broker_url) as conn, conn.Producer() as producer:
            for index in indexes:
                run_shard_task.apply_async((job_id, index), queue=self.shard_queue, producer=producer)

    def submit(self, rows: list[dict], shard_size: int) -> str:
        job_id = self.create_job(rows, shard_size)
        with self.Session() as s:
            self.enqueue(job_id, range(get_job(s, job_id).num_shards))
        return job_id

    def cli(self, *args, timeout: float = WAIT_S) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "cli", *args], env=self.env, cwd=REPO,
                              capture_output=True, text=True, timeout=timeout)

    # the ledger
    def job(self, job_id: str):
        with self.Session() as s:
            return get_job(s, job_id)

    def shards(self, job_id: str):
        with self.Session() as s:
            return get_shards(s, job_id)

    def wait_for(self, what: str, predicate, timeout: float = WAIT_S, poll_s: float = 0.2):
        """polling.wait_until, with this cluster's logs if it times out."""
        return wait_until(what, predicate, timeout, poll_s, diagnostics=self.all_logs)

    def wait_until_ended(self, job_id: str, timeout: float = WAIT_S):
        return self.wait_for(f"job {job_id} to end", lambda: (job := self.job(job_id)).finished_at and job, timeout)

    def running_mid_generation(self, job_id: str, together: int = 1, long_from: int | None = None):
        """A shard that is running whose lease was renewed at least once after the claim, on
        a worker that already committed a shard (so its engine is loaded and the shard is
        really generating). With long_from, only shards from that index on (the long ones of
        warm_then_long) count, on any worker whose log says its engine is loaded: shards
        then need not wait for a quick one to commit on the same worker. With together=2: a
        list of two such shards held by the same worker process (its shards in flight), or None."""
        shards = self.shards(job_id)
        warm = {sh.worker.rsplit(":", 1)[1] for sh in shards if sh.status == "completed" and sh.worker}
        if long_from is not None:
            warm |= {str(p.pid) for p in self.procs if " loaded in " in self.log(p)}
        by_pid: dict[str, list] = {}
        for sh in shards:
            if long_from is not None and sh.index < long_from:
                continue
            if (sh.status == "running" and sh.heartbeat_at and sh.started_at
                    and (sh.heartbeat_at - sh.started_at).total_seconds() >= 0.9
                    and sh.worker.rsplit(":", 1)[1] in warm):
                if together == 1:
                    return sh
                by_pid.setdefault(sh.worker.rsplit(":", 1)[1], []).append(sh)
        return next((group[:together] for group in by_pid.values() if len(group) >= together), None)

    # the invariant
    def assert_answered_once(self, job_ids: list[str], expected_ids: list[str]) -> None:
        """Each id has exactly one successful answer over the jobs' results (an original and its
        retries), and appears at most once in each job."""
        answered = Counter()
        for job_id in job_ids:
            rows = read_results(JobPaths(self.root, job_id).results_dir).to_pylist()
            assert max(Counter(r["id"] for r in rows).values(), default=1) == 1, job_id
            answered.update(r["id"] for r in rows if r["finish_reason"] in ("stop", "length"))
        assert answered == Counter(expected_ids), {i: answered[i] for i in expected_ids if answered[i] != 1}

    def assert_exactly_once(self, job_id: str, expected_ids: list[str], choices: dict[str, int] | None = None):
        """Each (id, choice) exactly once in the results dataset (choices: n of the ids that
        have several), exact ledger counts per request, empty _tmp."""
        jp = JobPaths(self.root, job_id)
        table = pads.dataset(str(jp.results_dir), format="parquet").to_table()  # as any pyarrow reader sees it
        counts = Counter(zip(table["id"].to_pylist(), table["choice"].to_pylist()))
        expected = [(i, c) for i in expected_ids for c in range((choices or {}).get(i, 1))]
        assert sorted(counts) == sorted(expected) and set(counts.values()) == {1}, \
            {i: n for i, n in counts.items() if n != 1} or sorted(set(expected) ^ set(counts))
        outcome: dict[str, set] = {}
        for r in table.select(["id", "finish_reason"]).to_pylist():
            outcome.setdefault(r["id"], set()).add(r["finish_reason"])
        ok = sum(reasons <= {"stop", "length"} for reasons in outcome.values())
        failed = sum("error" in reasons for reasons in outcome.values())
        job, shards = self.job(job_id), self.shards(job_id)
        assert (job.completed_requests, job.failed_requests) == (ok, failed)
        assert sum(sh.completed_requests for sh in shards) == ok
        assert sum(sh.failed_requests for sh in shards) == failed
        assert job.total_requests == len(expected_ids)
        # every row was written by the attempt that committed its shard
        attempts = {sh.index: sh.attempt for sh in shards}
        assert all(attempts[r["shard"]] == r["attempt"] for r in table.select(["shard", "attempt"]).to_pylist())
        assert not list(jp.tmp_dir.glob("*")), list(jp.tmp_dir.glob("*"))
        return table
