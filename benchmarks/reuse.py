#!/usr/bin/env python3
"""A nightly rerun against its first night: the same greedy file with a share of lines changed.

    python benchmarks/reuse.py [--lines 2000] [--changed 0.05] [--model DIR] [--max-tokens 32] [--via run|submit]

Runs the file, then the file with `--changed` of its lines edited, then the first file
again unchanged, in a fresh data directory, and prints one JSON line per job with the
ledger's wall_seconds, requests computed and reused, the command's own wall time, and the
rerun's wall time as a share of the first's. --via run (the default) uses `pipeline run`;
--via submit starts one `pipeline worker` (Redis at PIPELINE_BROKER_URL, a queue of its
own) and uses `pipeline submit --wait`, where the unchanged night is answered at submit.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jobs.ledger import get_job, make_engine, session_factory
from jobs.paths import default_database_url

WORDS = ("river mountain engine garden letter market window history science music ocean "
         "summer winter city road forest light stone bridge harbour").split()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=2000)
    ap.add_argument("--changed", type=float, default=0.05)
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--via", choices=("run", "submit"), default="run")
    args = ap.parse_args()
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(8, 40))) for _ in range(args.lines)]
    changed = set(rng.sample(range(args.lines), int(args.lines * args.changed)))
    root = Path(tempfile.mkdtemp(prefix="reuse-bench-"))
    env = {**os.environ, "PIPELINE_DATA_DIR": str(root / "data"), "PIPELINE_QUEUE": f"reuse-bench-{root.name}"}
    model = ["--model", args.model] if args.model else []
    worker = None
    if args.via == "submit":
        worker = subprocess.Popen([sys.executable, "-m", "cli", "worker", *model], env=env,
                                  stdout=subprocess.DEVNULL, stderr=open(root / "worker.log", "w"))
    Session = None
    results = []
    try:
        for night, edit in (("first", set()), ("rerun", changed), ("unchanged", set())):
            src = root / f"{night}.jsonl"
            src.write_text("".join(json.dumps({"id": f"r{i}", "prompt": p + (" (revised)" if i in edit else ""),
                                               "max_tokens": args.max_tokens, "temperature": 0}) + "\n"
                                   for i, p in enumerate(prompts)))
            verb = ["run", str(src)] if args.via == "run" else ["submit", str(src), "--wait"]
            start = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "cli", *verb, *model], env=env,
                                  capture_output=True, text=True, check=True)
            command_s = time.perf_counter() - start
            job_id = re.search(r"(job_[0-9a-f]{16})", done.stdout)[1]
            Session = Session or session_factory(make_engine(default_database_url(root / "data")))
            with Session() as s:
                job = get_job(s, job_id)
            results.append({"night": night, "via": args.via, "job": job_id,
                            "wall_seconds": round(job.wall_seconds, 2), "command_seconds": round(command_s, 2),
                            "requests": job.total_requests, "reused": job.reused_requests,
                            "computed": job.total_requests - job.reused_requests})
            print(json.dumps(results[-1]), flush=True)
    finally:
        if worker is not None:
            worker.terminate()
            worker.wait(timeout=60)
    print(json.dumps({"rerun_wall_share": round(results[1]["wall_seconds"] / results[0]["wall_seconds"], 4),
                      "unchanged_command_share": round(results[2]["command_seconds"] / results[0]["command_seconds"], 4)}))


if __name__ == "__main__":
    main()
