#!/usr/bin/env python3
"""Does a worker keep its engine busy across shard boundaries? (issue 11's benchmark)

One real `pipeline worker` (its engine loaded by a small first job), then for each pair:
a W1-shape job submitted in small shards, its total tok/s read from the ledger, and
`pipeline bench` on the same file right after. Each pair uses its own workload seed, so
the worker's prefix cache never serves a repeated prompt. Prints one JSON line per run
and the ratio of each pair.

    python benchmarks/shard_feed.py --pairs 3 --n 96 --shard-size 12
    python benchmarks/shard_feed.py --mode run --n 128 --shard-size 16   # `pipeline run` instead

Needs Redis on 127.0.0.1:6379 (the worker mode) and ../shared/bench/workload.py.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

WORKLOAD = Path(__file__).resolve().parents[2] / "shared" / "bench" / "workload.py"


def cli(*args, env, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", *args], env=env, text=True,
                          capture_output=True, check=True, **kw)


def make_workload(model_dir: str, out: Path, n: int, seed: int) -> Path:
    subprocess.run([sys.executable, str(WORKLOAD), "--model", model_dir, "--out", str(out), "--n", str(n),
                    "--prompt", "16:256", "--output", "8:128", "--seed", str(seed)], check=True,
                   capture_output=True)
    return out


def job_row(db: Path, job_id: str) -> dict:
    with sqlite3.connect(db) as conn:
        conn.row_factory = sqlite3.Row
        return dict(conn.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone())


def wait_ended(db: Path, job_id: str, timeout_s: float = 1800) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        row = job_row(db, job_id)
        if row["status"] in ("completed", "failed", "cancelled", "expired"):
            return row
        time.sleep(2)   # seldom: this poll shares the machine with the worker
    raise TimeoutError(f"job {job_id} did not end in {timeout_s} s")


def thread_cpu(pid: int) -> dict:
    """(seconds on a CPU, seconds runnable but waiting for one) of each thread of pid so
    far, by thread id (from /proc/.../schedstat), and "process": the CPU seconds of the
    whole process, threads that ended included."""
    cpu = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):   # a thread that just ended
            run_ns, wait_ns, _ = (task / "schedstat").read_text().split()
            cpu[int(task.name)] = (int(run_ns) / 1e9, int(wait_ns) / 1e9)
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu["process"] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return cpu


def thread_names(pid: int) -> dict[int, str]:
    """Thread names by thread id: Python's names from py-spy where it is installed, else the OS's."""
    names = {int(t.name): (t / "comm").read_text().strip() for t in Path(f"/proc/{pid}/task").iterdir()}
    try:
        dump = subprocess.run(["py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True).stdout
    except FileNotFoundError:
        return names
    names.update({int(tid): name for tid, name in re.findall(r'^Thread (\d+) \(\w+\): "([^"]*)"', dump, re.M)})
    return names


def cpu_by_thread(pid: int, before: dict) -> dict:
    """[CPU s, runnable-waiting s] each thread used since `before`, summed by name, busiest first."""
    names, used = thread_names(pid), {}
    now = thread_cpu(pid)
    process = now.pop("process") - before["process"]
    for tid, (run, wait) in now.items():
        run0, wait0 = before.get(tid, (0.0, 0.0))
        name = names.get(tid, "?")
        total = used.setdefault(name, [0.0, 0.0])
        total[0] += run - run0
        total[1] += wait - wait0
    busiest = sorted(used.items(), key=lambda kv: -kv[1][0])
    return {"process_cpu_s": round(process, 2),
            **{k: [round(v[0], 2), round(v[1], 2)] for k, v in busiest if v[0] >= 0.01}}


def job_line(mode: str, row: dict) -> dict:
    return {"engine": f"pipeline {mode}", "requests": row["total_requests"], "prompt_tokens": row["prompt_tokens"],
            "output_tokens": row["output_tokens"], "wall_seconds": round(row["wall_seconds"], 3),
            "total_tok_s": round(row["total_tok_s"], 2)}


def run_job(args, env, db: Path, requests: Path, model_args: list, worker) -> dict:
    """Submit (worker mode) or run `requests` as a job in shards; its ledger line."""
    shard = ["--shard-size", str(args.shard_size)]
    if worker is not None:
        before = thread_cpu(worker.pid)
        job_id = cli("submit", str(requests), *shard, *model_args, env=env).stdout.strip()
    else:
        cli("run", str(requests), *shard, *model_args, env=env)
        with sqlite3.connect(db) as conn:
            job_id = conn.execute("SELECT id FROM jobs ORDER BY created_at DESC LIMIT 1").fetchone()[0]
    line = job_line(args.mode, wait_ended(db, job_id))
    if args.thread_cpu and worker is not None:
        line["worker_thread_cpu_s"] = cpu_by_thread(worker.pid, before)
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("worker", "run"), default="worker")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--n", type=int, default=96, help="requests per job")
    ap.add_argument("--shard-size", type=int, default=12)
    ap.add_argument("--shards-in-flight", type=int, help="[default: the setting's]")
    ap.add_argument("--model", help="model directory [default: the bundled model]")
    ap.add_argument("--thread-cpu", action="store_true",
                    help="also print the CPU seconds each worker thread used during each job")
    args = ap.parse_args()

    from pipeline.models.bundled import bundled_model_dir
    model_dir = args.model or str(bundled_model_dir())
    tmp = Path(tempfile.mkdtemp(prefix="shard-feed-"))
    env = {**os.environ, "PIPELINE_DATA_DIR": str(tmp / "data"), "PIPELINE_QUEUE": f"bench-{uuid.uuid4().hex[:8]}"}
    env.pop("PIPELINE_DATABASE_URL", None)   # the data dir's SQLite ledger
    if args.shards_in_flight:
        env["PIPELINE_SHARDS_IN_FLIGHT"] = str(args.shards_in_flight)
    model_args = ["--model", args.model] if args.model else []
    db = tmp / "data" / "ledger.sqlite"
    cli("db", "upgrade", env=env)

    worker = None
    if args.mode == "worker":
        log = open(tmp / "worker.log", "wb")
        worker = subprocess.Popen([sys.executable, "-m", "cli", "worker", "--loglevel", "warning"],
                                  env=env, stdout=log, stderr=subprocess.STDOUT)
        warm = tmp / "warm.jsonl"
        warm.write_text("".join(json.dumps({"id": f"warm{i}", "prompt": "Hello", "max_tokens": 4}) + "\n"
                                for i in range(4)))
        wait_ended(db, cli("submit", str(warm), *model_args, env=env).stdout.strip())
    try:
        ratios = []
        for pair in range(args.pairs):
            requests = make_workload(model_dir, tmp / f"w-{pair}.jsonl", args.n, seed=pair)
            # Odd pairs run the bench first, so a drift in the machine's speed cancels out.
            order = ("job", "bench") if pair % 2 == 0 else ("bench", "job")
            lines = {}
            for what in order:
                if what == "bench":
                    lines["bench"] = json.loads(cli("bench", str(requests), *model_args, env=env).stdout)
                else:
                    lines["job"] = run_job(args, env, db, requests, model_args, worker)
                print(json.dumps(lines[what]), flush=True)
            ratios.append(lines["job"]["total_tok_s"] / lines["bench"]["total_tok_s"])
            print(json.dumps({"pair": pair, "shard_size": args.shard_size, "ratio": round(ratios[-1], 3)}),
                  flush=True)
        # The machine's speed drifts by more than the effect between runs: quote the spread too.
        print(json.dumps({"pairs": len(ratios), "mean_ratio": round(statistics.mean(ratios), 3),
                          "median_ratio": round(statistics.median(ratios), 3),
                          "min_ratio": round(min(ratios), 3), "max_ratio": round(max(ratios), 3)}), flush=True)
    finally:
        if worker is not None:
            worker.send_signal(signal.SIGTERM)
            worker.wait(timeout=60)


if __name__ == "__main__":
    main()
