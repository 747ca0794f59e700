"""gpu_product.py's steps: the product's own commands, each a subprocess, as a user runs them.

Every step returns the fields of its JSON line and raises on what it cannot do; Product
holds what they share (the environment every command gets, the data root and its SQLite
ledger, the files, the models, the jobs made so far). The step's status: "passed" or
"failed" against its check, "measured" where only a number comes out.
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

# Words for W1-shaped prompts: every one at least a token, so k words cut to k tokens.
WORDS = ("garden river market engine window letter ocean music science history mountain station village "
         "morning evening winter summer animal forest island bridge kitchen doctor teacher student number "
         "picture question answer problem country language machine company family friend people water "
         "paper money night light voice story world house table chair street city school reason").split()
FINISHED = ("completed", "failed", "cancelled", "expired")
RATIO_TARGET = 0.9


def w1_lines(tokenizer, n: int, prompt: tuple[int, int], output: tuple[int, int], seed: int = 0):
    """W1's shape (the lines ../shared/bench/workload.py writes, which does not travel to a
    device): random words cut to k tokens of `tokenizer` and decoded, greedy, output lengths
    forced by ignore_eos."""
    rng = random.Random(seed)
    for i in range(n):
        k = rng.randint(*prompt)
        ids = tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(k)), add_special_tokens=False).ids[:k]
        yield {"id": f"w{i:05d}", "prompt": tokenizer.decode(ids), "max_tokens": rng.randint(*output),
               "temperature": 0.0, "ignore_eos": True}


def corpus_lines(n: int, words: tuple[int, int], seed: int = 1):
    """An embedding job's lines: one text each."""
    rng = random.Random(seed)
    for i in range(n):
        yield {"id": f"e{i:05d}", "input": " ".join(rng.choice(WORDS) for _ in range(rng.randint(*words)))}


def write_jsonl(path: Path, rows) -> Path:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """The Python child processes of pid (Linux): a supervisor's engine processes, not a
    compiler that builds a kernel."""
    kids = []
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                program = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
                if Path(program).name.startswith("python") or Path(program).name == "pipeline":
                    kids.append(int(child))
    return kids


class Product:
    def __init__(self, tmp: Path, env: dict, engine_args: list[str], key_args: list[str], shard_size: int,
                 deadline: float, lease_s: int):
        self.tmp, self.env, self.deadline = tmp, env, deadline
        self.engine_args = engine_args   # the worker's and `pipeline run`'s engine options, --model excluded
        self.key_args = key_args         # those of them that name the engine (a submitted job's)
        self.shard_size, self.lease_s = shard_size, lease_s
        self.data = Path(env["PIPELINE_DATA_DIR"])
        self.ledger = self.data / "ledger.sqlite"
        self.jobs: dict[str, str] = {}   # step -> job id
        self.processes: list[subprocess.Popen] = []
        self.gpus_option = False         # whether `pipeline worker` has --gpus (one child per GPU)

    # --- commands
    def left(self) -> float:
        return self.deadline - time.monotonic()

    def cli(self, *args: str, timeout: float | None = None, check: bool = True) -> subprocess.CompletedProcess:
        """`pipeline ARGS` to its end (within the deadline)."""
        timeout = max(5.0, min(timeout or self.left(), self.left()))
        done = subprocess.run([sys.executable, "-m", "cli", *args], env=self.env, cwd=self.tmp, capture_output=True,
                              text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"pipeline {' '.join(args[:2])} exited {done.returncode}: "
                               f"{(done.stderr or done.stdout)[-1500:]}")
        return done

    def start(self, name: str, *args: str) -> subprocess.Popen:
        """`pipeline ARGS` in the background, its output in tmp/NAME.log; stopped by stop_all."""
        with open(self.tmp / f"{name}.log", "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "cli", *args], env=self.env, cwd=self.tmp, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.processes.append(proc)
        return proc

    def log(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop_all(self) -> None:
        """SIGTERM (a worker hands its shards back, a supervisor drains its children), then SIGKILL."""
        for proc in self.processes:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.processes:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    # --- the ledger and the results
    def sql(self, query: str, *params) -> list[dict]:
        with contextlib.closing(sqlite3.connect(self.ledger, timeout=30)) as conn:
            conn.row_factory = sqlite3.Row
            return [dict(row) for row in conn.execute(query, params)]

    def newest_job(self, exclude=()) -> str | None:
        rows = self.sql("SELECT id FROM jobs ORDER BY created_at DESC")
        return next((r["id"] for r in rows if r["id"] not in exclude), None)

    def job(self, job_id: str) -> dict:
        return self.sql("SELECT * FROM jobs WHERE id = ?", job_id)[0]

    def results(self, job_id: str, columns: list[str]) -> dict:
        import pyarrow.dataset as ds
        return ds.dataset(self.data / "jobs" / job_id / "results", format="parquet").to_table(columns=columns) \
            .to_pydict()

    def each_once(self, job_id: str, ids: list[str]) -> dict:
        """Every input id answered exactly once (choice 0), nothing else, no error rows."""
        rows = self.results(job_id, ["id", "choice", "finish_reason"])
        counts = collections.Counter(zip(rows["id"], rows["choice"]))
        twice = sorted(i for (i, _), c in counts.items() if c > 1)
        missing = sorted(set(ids) - set(rows["id"]))
        extra = sorted(set(rows["id"]) - set(ids))
        errors = sum(reason in ("error", "cancelled", "timeout") for reason in rows["finish_reason"])
        return dict(rows=len(rows["id"]), twice=twice[:5], missing=missing[:5], extra=extra[:5], error_rows=errors,
                    exactly_once=not (twice or missing or extra) and len(rows["id"]) == len(ids))

    # --- the steps
    def run_job(self, requests: Path, model: Path, ids: list[str], name: str = "run") -> dict:
        """`pipeline run FILE`: to Parquet and the SQLite ledger, here in one process."""
        start = time.monotonic()
        self.cli("run", str(requests), "--model", str(model), *self.engine_args)
        seconds = time.monotonic() - start
        job_id = self.jobs[name] = self.newest_job(exclude=self.jobs.values())
        job, once = self.job(job_id), self.each_once(job_id, ids)
        ok = job["status"] == "completed" and job["completed_requests"] == len(ids) and once["exactly_once"]
        return dict(status="passed" if ok else "failed", job=job_id, job_status=job["status"],
                    completed=job["completed_requests"], failed=job["failed_requests"],
                    output_tokens=job["output_tokens"], wall_seconds=job["wall_seconds"],
                    output_tok_s=job["output_tok_s"], command_seconds=round(seconds, 1), **once)

    def bench(self, requests: Path, model: Path, job_output_tok_s: float | None, judged: bool) -> dict:
        """`pipeline bench FILE` on the same file: the job's output tok/s over bench's."""
        line = json.loads(self.cli("bench", str(requests), "--model", str(model), *self.engine_args)
                          .stdout.strip().splitlines()[-1])
        ratio = job_output_tok_s / line["output_tok_s"] if job_output_tok_s else None
        status = ("passed" if ratio and ratio >= RATIO_TARGET else "failed") if judged else "measured"
        return dict(status=status, bench_output_tok_s=line["output_tok_s"], job_output_tok_s=job_output_tok_s,
                    ratio=ratio and round(ratio, 3), target=RATIO_TARGET, bench_seconds=line["seconds"],
                    steps=line.get("steps"), kv_blocks=line.get("kv_blocks"))

    def worker_kill(self, requests: Path, model: Path, ids: list[str], worker_args: list[str]) -> dict:
        """Redis, `pipeline worker`, `pipeline submit --wait` of the same file; once a shard has
        committed and others run, SIGKILL a worker child (a supervisor restarts it) or, with
        no child, the worker itself (then another is started): every id still exactly once."""
        model_args = ["--model", str(model)]
        self.cli("db", "upgrade")
        workers = [self.start("worker-0", "worker", *model_args, *self.engine_args, *worker_args)]
        start = time.monotonic()
        submit = self.start("submit", "submit", str(requests), *model_args, *self.key_args, "--no-reuse",
                            "--shard-size", str(self.shard_size), "--wait")
        job_id, killed, restart_s, before, killed_at = None, None, None, set(), 0.0
        while submit.poll() is None and self.left() > 5:
            time.sleep(0.1)
            if workers[0].poll() is not None and killed is None:
                raise RuntimeError(f"the worker exited {workers[0].returncode}: {self.log('worker-0')[-1500:]}")
            job_id = job_id or self.newest_job(exclude=self.jobs.values())
            if job_id is None:
                continue
            if killed is None:
                states = collections.Counter(r["status"] for r in self.sql(
                    "SELECT status FROM shards WHERE job_id = ?", job_id))
                if states["completed"] >= 1 and states["running"] >= 1:
                    before = set(children(workers[0].pid))   # a restarted child is one not among them
                    killed = self._kill(workers, worker_args, model_args, states, sorted(before))
                    killed_at = time.monotonic()
            elif killed["role"] == "child" and restart_s is None and set(children(workers[0].pid)) - before:
                restart_s = round(time.monotonic() - killed_at, 1)
        if submit.poll() is None:
            raise TimeoutError(f"`pipeline submit --wait` did not end in time: {self.log('submit')[-800:]}")
        seconds = time.monotonic() - start
        job_id = self.jobs["worker"] = job_id or self.newest_job(exclude=self.jobs.values())
        job, once = self.job(job_id), self.each_once(job_id, ids)
        attempts = self.sql("SELECT attempt FROM shards WHERE job_id = ?", job_id)
        plan = [line.split("KV cache:", 1)[1].strip() for line in self.log("worker-0").splitlines()
                if "KV cache:" in line]
        ok = (submit.returncode == 0 and killed is not None and job["status"] == "completed" and once["exactly_once"]
              and (killed["role"] == "worker" or restart_s is not None))
        return dict(status="passed" if ok else "failed", job=job_id, submit_exit=submit.returncode,
                    job_status=job["status"], killed=killed, child_restarted_after_s=restart_s,
                    shards=len(attempts), shards_run_again=sum(a["attempt"] > 1 for a in attempts),
                    output_tok_s=job["output_tok_s"], submit_seconds=round(seconds, 1), kv_cache_plan=plan[:1],
                    **once)

    def _kill(self, workers, worker_args, model_args, states, kids: list[int]) -> dict:
        """SIGKILL one engine process mid-job: a child of the worker if it has one, else the worker."""
        worker = workers[0]
        if kids:
            victim, role = kids[0], "child"
        else:
            victim, role = worker.pid, "worker"
        os.kill(victim, signal.SIGKILL)
        if role == "worker":   # nothing restarts a plain worker: another takes its shards once their lease expires
            workers.append(self.start("worker-1", "worker", *model_args, *self.engine_args, *worker_args))
        return dict(role=role, pid=victim, children_before=len(kids), shards_completed=states["completed"],
                    shards_running=states["running"])

    def embedding(self, corpus: Path, model: Path, n: int, dims: int) -> dict:
        """An embedding job (`pipeline run` of `input` lines on an encoder): every vector, unit length."""
        start = time.monotonic()
        self.cli("run", str(corpus), "--model", str(model), *self.engine_args)
        seconds = time.monotonic() - start
        job_id = self.jobs["embedding"] = self.newest_job(exclude=self.jobs.values())
        job = self.job(job_id)
        vectors = self.results(job_id, ["embedding"])["embedding"]
        norms = [sum(x * x for x in v) ** 0.5 for v in vectors[:64]]
        ok = (job["status"] == "completed" and job["embedding_vectors"] == n and len(vectors) == n
              and all(len(v) == dims for v in vectors) and all(abs(x - 1) < 1e-2 for x in norms))
        return dict(status="passed" if ok else "failed", job=job_id, job_status=job["status"],
                    vectors=job["embedding_vectors"], dims=len(vectors[0]) if vectors else None,
                    vectors_s=job["vectors_s"], wall_seconds=job["wall_seconds"], command_seconds=round(seconds, 1))

    def status(self, job_id: str) -> dict:
        """`pipeline status JOB`, its --json Batch object, and the list of jobs."""
        text = self.cli("status", job_id).stdout
        batch = json.loads(self.cli("status", job_id, "--json").stdout)
        listed = self.cli("status").stdout
        ok = batch.get("status") == "completed" and "completed" in text and all(j in listed for j in self.jobs.values())
        return dict(status="passed" if ok else "failed", job=job_id, batch_status=batch.get("status"),
                    request_counts=batch.get("request_counts"), text_lines=len(text.splitlines()),
                    jobs_listed=sum(j in listed for j in self.jobs.values()))

    def energy(self, judged: bool) -> dict:
        """Each job's energy and device time as the ledger keeps them (issue 53, item 3), and the
        counters its shards were measured with. Judged (CUDA): every job measured, by NVML."""
        jobs = self.sql("SELECT id, joules, tokens_per_joule, device_seconds, energy_unmeasured FROM jobs "
                        "ORDER BY created_at")
        meters = sorted({r["energy_meter"] for r in self.sql("SELECT DISTINCT energy_meter FROM shards")
                         if r["energy_meter"]})
        measured = bool(jobs) and all(job["joules"] and job["joules"] > 0 for job in jobs)
        status = ("passed" if measured and meters and all(m.startswith("nvml") for m in meters) else "failed") \
            if judged else "measured"
        return dict(status=status, jobs=jobs, meters=meters)

    def sql_query(self) -> dict:
        """One SQL query on the ledger, as the README's tour runs it."""
        rows = self.sql("SELECT id, status, total_requests, completed_requests, failed_requests, output_tok_s, "
                        "embedding_vectors, vectors_s FROM jobs ORDER BY created_at")
        ok = len(rows) == len(self.jobs) and all(r["status"] == "completed" for r in rows)
        return dict(status="passed" if ok else "failed", rows=rows)
