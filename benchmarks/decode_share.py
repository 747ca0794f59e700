#!/usr/bin/env python3
"""What share of a long job's engine steps are decode-only: the steps CUDA graphs replay.

    python benchmarks/decode_share.py [--requests 2048] [--seqs 256] [--groups 1,16,32,64]

A tiny random Llama (host_step.py's) on the CPU runs `requests` greedy requests shaped like
W1 (gpu_speed.refill_requests: prompts of 16-256 tokens, 8-128 output tokens) through an engine holding `seqs`
sequences, with CUDA's default token budget (8,192) where seqs > 64. As requests finish,
waiting ones take their slots; each admission puts a prefill beside the decodes, and such
a mixed step runs eagerly on a GPU. For each admission group (EngineConfig.admission_group:
the free slots that admit new work while others decode) one JSON line: steps, decode-only
steps and their share, the mean batch. What a step costs is not measured: on a CPU it is
the same whether or not a graph could replay it.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from gpu_models import build_model, find_tokenizer
from gpu_speed import refill_requests
from host_step import TINY
from pipeline import EngineConfig
from pipeline.engine.engine import Engine


def count_steps(model: Path, requests: int, seqs: int, group: int) -> dict:
    engine = Engine(EngineConfig(model=str(model), device="cpu", dtype="float32", max_num_seqs=seqs,
                                 max_num_batched_tokens=8192 if seqs > 64 else None, kv_cache_gib=1,
                                 admission_group=group))
    layouts = []
    prepare = engine.runner._prepare
    engine.runner._prepare = lambda *args: layouts.append(prepare(*args)) or layouts[-1]
    outputs = list(engine.generate(refill_requests(requests)))
    if any(o.error for o in outputs):
        raise RuntimeError(f"a request failed: {next(o.error for o in outputs if o.error)}")
    decode_only = sum(layout.is_plain_decode for layout in layouts)
    return {"requests": requests, "max_num_seqs": seqs, "admission_group": engine.scheduler.admission_group,
            "steps": len(layouts), "decode_only_steps": decode_only, "share": round(decode_only / len(layouts), 3),
            "mean_batch": round(sum(layout.num_seqs for layout in layouts) / len(layouts), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2048)
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--groups", default="1,16,32,64", help="admission groups to count, comma-separated")
    parser.add_argument("--tokenizer", help="a folder with tokenizer.json (default: the bundled model's)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "tiny", TINY, find_tokenizer(args.tokenizer), torch.float32)
        for group in (int(g) for g in args.groups.split(",")):
            print(json.dumps(count_steps(model, args.requests, args.seqs, group)), flush=True)


if __name__ == "__main__":
    main()
