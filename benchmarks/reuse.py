#!/usr/bin/env python3
"""A nightly rerun against its first night: the same greedy file with a share of lines changed.

    python benchmarks/reuse.py [--lines 2000] [--changed 0.05] [--model DIR] [--max-tokens 32]

Runs `pipeline run` on the file, then on the file with `--changed` of its lines edited, in a
fresh data directory, and prints one JSON line per job with the ledger's wall_seconds,
requests computed and reused, and the rerun's wall time as a share of the first's.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import tempfile
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
    args = ap.parse_args()
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(8, 40))) for _ in range(args.lines)]
    changed = set(rng.sample(range(args.lines), int(args.lines * args.changed)))
    root = Path(tempfile.mkdtemp(prefix="reuse-bench-"))
    Session = None
    results = []
    for night, edit in (("first", set()), ("rerun", changed)):
        src = root / f"{night}.jsonl"
        src.write_text("".join(json.dumps({"id": f"r{i}", "prompt": p + (" (revised)" if i in edit else ""),
                                           "max_tokens": args.max_tokens, "temperature": 0}) + "\n"
                               for i, p in enumerate(prompts)))
        cmd = [sys.executable, "-m", "pipeline.cli", "run", str(src), "--data-dir", str(root / "data")]
        if args.model:
            cmd += ["--model", args.model]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        job_id = re.search(r"job (job_[0-9a-f]{16})", done.stdout)[1]
        Session = Session or session_factory(make_engine(default_database_url(root / "data")))
        with Session() as s:
            job = get_job(s, job_id)
        results.append({"night": night, "job": job_id, "wall_seconds": round(job.wall_seconds, 2),
                        "requests": job.total_requests, "reused": job.reused_requests,
                        "computed": job.total_requests - job.reused_requests})
        print(json.dumps(results[-1]), flush=True)
    print(json.dumps({"rerun_wall_share": round(results[1]["wall_seconds"] / results[0]["wall_seconds"], 4)}))


if __name__ == "__main__":
    main()
