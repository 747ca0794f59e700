#!/usr/bin/env python3
"""The dry run's duration estimate against the real run, on job shapes it has not seen.

    python benchmarks/dry_run_estimate.py [--model DIR] [--shapes small,medium,large] [--history history]
    python benchmarks/dry_run_estimate.py --shapes small-wide,medium-wide,large-wide

In a fresh data directory: one `pipeline run` of the history shape (the only job the
ledger then knows), then for each shape a `--dry-run --json` and the real `pipeline run`
of the same file, each shape's file different from the history's. Prints one JSON line per
shape: the estimate, the ledger's wall_seconds of the real job (what the estimate is of:
from its first shard's claim to its end, the engine's load not included), the command's
own wall time, and estimate / actual. Answers are never reused (--no-reuse): each file is
computed. The bundled model by default; greedy chat requests, so answers end at EOS or
max_tokens as a night's would.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jobs.ledger import get_job, list_jobs, make_engine, session_factory
from jobs.paths import default_database_url

TOPICS = ("the sea", "a lighthouse", "winter in a city", "a bridge", "bees", "an old letter", "a market",
          "trains", "a forest fire", "the moon", "bread", "a library", "volcanoes", "a violin", "rain")
ASKS = ("Write a short poem about {t}.", "Explain {t} to a child in two sentences.",
        "List three facts about {t}.", "Describe {t} in one paragraph.", "Tell a very short story about {t}.")
# (requests, context words before the question, max_tokens): what each shape asks
SHAPES = {
    "history": (48, 20, 96),
    "small": (12, 0, 64),
    "medium": (64, 120, 128),
    "large": (192, 300, 192),
    # the same sizes where the history's throughput says least: a batch far from full, a
    # max_tokens far above what answers take
    "small-wide": (4, 0, 256),
    "medium-wide": (48, 60, 512),
    "large-wide": (256, 150, 128),
}


def lines_of(shape: str, seed: int) -> list[dict]:
    n, context_words, max_tokens = SHAPES[shape]
    rng = random.Random(seed)
    words = "river mountain engine garden letter window history science music summer stone harbour".split()
    out = []
    for i in range(n):
        context = " ".join(rng.choice(words) for _ in range(context_words))
        ask = rng.choice(ASKS).format(t=rng.choice(TOPICS))
        content = f"Notes: {context}\n\n{ask}" if context else ask
        out.append({"id": f"{shape}-{i}", "messages": [{"role": "user", "content": content}],
                    "max_tokens": max_tokens, "temperature": 0})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--shapes", default="small,medium,large")
    ap.add_argument("--history", default="history", help="the shape run first, as the ledger's only history")
    ap.add_argument("--root", default=None, help="the data directory's parent (default: a fresh temporary one)")
    args = ap.parse_args()
    root = Path(args.root or tempfile.mkdtemp(prefix="dry-run-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PIPELINE_DATA_DIR": str(root / "data")}
    env.pop("PIPELINE_DATABASE_URL", None)
    model = ["--model", args.model] if args.model else []
    Session = None

    def run(shape: str, seed: int, dry: bool):
        src = root / f"{shape}-{seed}.jsonl"
        src.write_text("".join(json.dumps(line) + "\n" for line in lines_of(shape, seed)))
        cmd = [sys.executable, "-m", "cli", "run", str(src), *model, "--no-reuse"]
        start = time.perf_counter()
        done = subprocess.run(cmd + (["--dry-run", "--json"] if dry else []), env=env, capture_output=True,
                              text=True)
        took = time.perf_counter() - start
        if done.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return done, took

    for seed, shape in enumerate([args.history, *args.shapes.split(",")]):
        if shape != args.history:
            dry, dry_s = run(shape, seed, dry=True)
            figures = json.loads(dry.stdout)
        _, took = run(shape, seed, dry=False)
        Session = Session or session_factory(make_engine(default_database_url(root / "data")))
        with Session() as s:
            job = get_job(s, list_jobs(s)[0].id)
        record = {"shape": shape, "requests": job.total_requests, "prompt_tokens": job.prompt_tokens,
                  "output_tokens": job.output_tokens, "wall_seconds": round(job.wall_seconds, 1),
                  "command_s": round(took, 1)}
        if shape != args.history:
            estimated = figures["estimated_s"]
            record.update(estimated_s=None if estimated is None else round(estimated, 1), dry_run_s=round(dry_s, 1),
                          output_token_ceiling=figures["output_token_ceiling"],
                          expected_output_tokens=figures.get("expected_output_tokens"),
                          ratio=None if estimated is None else round(estimated / job.wall_seconds, 2))
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
