"""Structured outputs' cost: the same prompts unconstrained and under a JSON schema, one engine, one run.

    python benchmarks/structured_output.py w1.jsonl [--dtype float32] [--repeat 2]

w1.jsonl is a workload of ../shared/bench/workload.py (W1: --n 64 --prompt 16:256 --output
8:128 --seed 0). Every request is run twice, alternating A B A B: free text (ignore_eos,
so it runs to max_tokens) and constrained by a schema that allows long answers (an object
holding an array of strings, up to max_tokens). The schema's answers may end earlier, so the
figure compared is output tokens per second. Prints one JSON line per run and a summary
with the ratio and the share of step time spent computing and applying the grammar masks.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"}}},
          "required": ["items"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workload")
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()

    from cli.bench import read_workload
    from pipeline.config import EngineConfig
    from pipeline.engine.engine import Engine
    from pipeline.request import Request
    from pipeline.sampling_params import SamplingParams

    free = read_workload(args.workload)
    constrained = [Request(r.id, prompt=r.prompt, params=SamplingParams(
        max_tokens=r.params.max_tokens, temperature=r.params.temperature, structured_output={"json": SCHEMA}))
        for r in free]
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype))
    mask_s = [0.0]
    real_mask = engine.structured.mask

    def timed_mask(*a, **kw):
        start = time.perf_counter()
        real_mask(*a, **kw)
        mask_s[0] += time.perf_counter() - start
    engine.structured.mask = timed_mask
    list(engine.generate([constrained[0]]))   # warm-up: the tokenizer conversion, the compile cache

    results: dict[str, list[dict]] = {"free": [], "constrained": []}
    for _ in range(args.repeat):
        for name, requests in (("free", free), ("constrained", constrained)):
            engine.reset_prefix_cache()
            mask_s[0] = 0.0
            start = time.perf_counter()
            outs = list(engine.generate(requests))
            seconds = time.perf_counter() - start
            tokens = sum(o.output_tokens for o in outs)
            row = {"run": name, "requests": len(outs), "output_tokens": tokens, "seconds": round(seconds, 3),
                   "output_tok_s": round(tokens / seconds, 2), "mask_share": round(mask_s[0] / seconds, 4),
                   "valid": sum(bool(o.valid) for o in outs) if name == "constrained" else None}
            results[name].append(row)
            print(json.dumps(row), flush=True)
    free_rate = statistics.median(r["output_tok_s"] for r in results["free"])
    constrained_rate = statistics.median(r["output_tok_s"] for r in results["constrained"])
    print(json.dumps({"summary": True, "free_output_tok_s": free_rate, "constrained_output_tok_s": constrained_rate,
                      "ratio": round(constrained_rate / free_rate, 3),
                      "mask_share": statistics.median(r["mask_share"] for r in results["constrained"])}))


if __name__ == "__main__":
    main()
