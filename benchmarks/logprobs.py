"""Logprobs' cost: the same workload without and with top_logprobs 5 on every request, one engine, one run.

    python benchmarks/logprobs.py w1.jsonl [--repeat 3]

w1.jsonl is a workload of ../shared/bench/workload.py (W1: --n 64 --prompt 16:256 --output
8:128 --seed 0). Runs alternate A B A B on one engine (the prefix cache emptied before
each), so the machine's drift hits both alike; prints one JSON line per run and the median
ratio of total tokens per second (issue target: at least 0.95).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workload")
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    from cli.bench import read_workload
    from pipeline.config import EngineConfig
    from pipeline.engine.engine import Engine

    plain = read_workload(args.workload)
    with_logprobs = [dataclasses.replace(r, params=dataclasses.replace(r.params, logprobs=args.top)) for r in plain]
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype))
    list(engine.generate([with_logprobs[0]]))   # warm-up
    rates: dict[str, list[float]] = {"plain": [], "logprobs": []}
    for _ in range(args.repeat):
        for name, requests in (("plain", plain), ("logprobs", with_logprobs)):
            engine.reset_prefix_cache()
            start = time.perf_counter()
            outs = list(engine.generate(requests))
            seconds = time.perf_counter() - start
            tokens = sum(o.prompt_tokens + o.output_tokens for o in outs)
            rates[name].append(tokens / seconds)
            print(json.dumps({"run": name, "seconds": round(seconds, 3), "total_tok_s": round(tokens / seconds, 2)}),
                  flush=True)
    ratios = [b / a for a, b in zip(rates["plain"], rates["logprobs"])]
    print(json.dumps({"summary": True, "plain_total_tok_s": round(statistics.median(rates["plain"]), 2),
                      "logprobs_total_tok_s": round(statistics.median(rates["logprobs"]), 2),
                      "ratio_median": round(statistics.median(ratios), 3),
                      "ratios": [round(r, 3) for r in ratios]}))


if __name__ == "__main__":
    main()
