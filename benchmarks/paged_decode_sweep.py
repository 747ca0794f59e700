#!/usr/bin/env python3
"""Choose the Triton paged decode kernel's launch tuning on a GPU, and measure what it buys
end to end. One JSON line each:

    python benchmarks/paged_decode_sweep.py [--before OLD_KERNEL.py] [--tokenizer DIR]

(Without a GPU it runs the same code on tiny sizes under Triton's interpreter: a smoke
test of this script, its numbers mean nothing.)

- `decode_config`: for each tuning (keys a tile, warps, pipeline stages, programs an SM)
  of pipeline/kernels/paged_decode_triton.py, gpu_attention.py's decode step (one
  Llama-3.2-1B-shaped layer in bf16, 256 sequences of 128-640 keys in scattered pages):
  microseconds a call (20 launches captured in a CUDA graph, as decode steps run, so no
  launch latency is counted; median of 5 replays), the context's bytes over that time as a
  share of HBM_BYTES_S, and its largest error against the reference backend; then the
  fastest with more programs an SM (its keys split further).
- `decode_best`: the fastest that is within gpu_attention.BOUND, then at 16 sequences
  (where the kernel splits keys) against the module's defaults; `--before`, a copy of an
  earlier version of the module, is timed the same way at both sizes.
- `decode_end_to_end`: gpu_speed.run_pipeline's workload (256 x 128-token prompts, 512
  greedy tokens each, the 1B-shaped random model), A B A B: the `--before` kernel (else the
  defaults) against the best tuning, output tok/s and its share of the HBM roofline.
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

import torch  # noqa: E402

CUDA = torch.cuda.is_available()
if not CUDA:   # the smoke test: Triton's interpreter, chosen before any kernel is defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

import gpu_models  # noqa: E402
from gpu_attention import BOUND, HEADS, decode_step  # noqa: E402
from gpu_quant import graphed_us  # noqa: E402
from gpu_speed import HBM_BYTES_S, roofline_output_tok_s, run_pipeline, workload  # noqa: E402
from pipeline.kernels import paged_decode_triton as kernel  # noqa: E402
from pipeline.layers.attention import LayerCache  # noqa: E402
from pipeline.layers.attention.varlen import ReferenceVarlenBackend  # noqa: E402

TUNABLES = ("TILE_ELEMENTS", "NUM_WARPS", "NUM_STAGES", "PROGRAMS_PER_SM")
GRID = dict(TILE_ELEMENTS=(2048, 4096), NUM_WARPS=(2, 4, 8), NUM_STAGES=(1, 2, 3))   # tiles of 32, 64 keys at head_dim 64
MORE_PROGRAMS = (8, 16, 32)   # PROGRAMS_PER_SM tried on the fastest of GRID


def emit(line: dict) -> None:
    print(json.dumps(line), flush=True)


class Step:
    """One decode step's inputs, its float32 reference output and its bytes of context."""

    def __init__(self, num_seqs: int):
        device, dtype = ("cuda", torch.bfloat16) if CUDA else ("cpu", torch.float16)   # see gpu_attention
        self.q, self.cache, self.meta = decode_step(num_seqs, 16, device, dtype)
        self.scale = HEADS[2] ** -0.5
        self.want = ReferenceVarlenBackend().forward(self.q.float(), None, None,
                                                     LayerCache(self.cache.k.float(), self.cache.v.float()),
                                                     self.meta, self.scale)
        self.kv_bytes = 2 * int(self.meta.seqused_k.sum()) * HEADS[1] * HEADS[2] * self.cache.k.element_size()

    def measure(self, attention) -> dict:
        def call():
            return attention(self.q, self.cache.k, self.cache.v, self.meta.block_table, self.meta.seqused_k,
                             self.scale)
        error = (call().float() - self.want).abs().max().item()
        us = round(graphed_us(call, "cuda" if CUDA else "cpu"), 2)
        return dict(us=us, hbm_share=round(self.kv_bytes / (us * 1e-6) / HBM_BYTES_S, 3), max_abs_error=round(error, 5))


def tuned(config: dict) -> None:
    for name, value in config.items():
        setattr(kernel, name, value)


def load_before(path: str):
    spec = importlib.util.spec_from_file_location("paged_decode_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", help="an earlier paged_decode_triton.py to compare with")
    ap.add_argument("--tokenizer", help="a folder with tokenizer.json (see gpu_models.find_tokenizer)")
    ap.add_argument("--budget-s", type=float, default=240.0, help="wall-clock budget")
    args = ap.parse_args()
    deadline = time.monotonic() + args.budget_s
    defaults = {name: getattr(kernel, name) for name in TUNABLES}
    before = load_before(args.before) if args.before else None

    big = Step(256 if CUDA else 8)
    results = []

    def sweep(configs):
        for config in configs:
            if time.monotonic() > deadline - 120:
                emit({"check": "decode_config", "status": "skipped", "reason": "budget"})
                return
            tuned(config)
            try:
                row = big.measure(kernel.paged_decode_attention)
            except Exception as e:   # a tuning that does not compile (shared memory, registers)
                emit({"check": "decode_config", "config": config, "error": f"{type(e).__name__}: {e}"[:300]})
                continue
            results.append((row["us"], config, row))
            emit({"check": "decode_config", "seqs": big.q.shape[0], "config": config, **row})

    def fastest():
        correct = [r for r in results if r[2]["max_abs_error"] <= BOUND]
        return dict(min(correct, key=lambda r: r[0])[1]) if correct else dict(defaults)

    grid = [dict(defaults, **dict(zip(GRID, values))) for values in itertools.product(*GRID.values())]
    sweep(grid if CUDA else grid[:2])
    sweep([dict(fastest(), PROGRAMS_PER_SM=n) for n in MORE_PROGRAMS])
    best = fastest()

    small = Step(16 if CUDA else 4)
    summary = {}
    for name, attention, config in (("defaults", kernel.paged_decode_attention, defaults),
                                    ("best", kernel.paged_decode_attention, best),
                                    ("before", before and before.paged_decode_attention, None)):
        if attention is None:
            continue
        if config:
            tuned(config)
        summary[name] = {f"seqs_{step.q.shape[0]}": step.measure(attention) for step in (big, small)}
    emit({"check": "decode_best", "best_config": best, **summary})
    del big, small
    torch.cuda.empty_cache()

    with tempfile.TemporaryDirectory(prefix="decode-sweep-") as tmp:
        device = "cuda" if CUDA else "cpu"
        shape, dtype = (gpu_models.LLAMA_1B, torch.bfloat16) if CUDA else (gpu_models.SMALL_SPEED, torch.float32)
        model_dir = gpu_models.build_model(Path(tmp) / "speed", shape, gpu_models.find_tokenizer(args.tokenizer),
                                           dtype, device=device)
        (n, prompt_len, output_len) = (256, 128, 512) if CUDA else (4, 16, 8)
        prompts = workload(n, prompt_len)
        tuned_fn = kernel.paged_decode_attention
        baseline = ("before", before.paged_decode_attention, defaults) if before else ("defaults", tuned_fn, defaults)
        rounds = []
        for name, attention, config in [baseline, ("best", tuned_fn, best)] * 2:
            if time.monotonic() > deadline - 25:
                rounds.append({"kernel": name, "skipped": "budget"})
                continue
            tuned(config)
            kernel.paged_decode_attention = attention   # what varlen_packed.triton_paged_decode imports
            try:
                ours = run_pipeline(model_dir, device, prompts, output_len, deadline)
            finally:
                kernel.paged_decode_attention = tuned_fn
            roof = roofline_output_tok_s(ours["weight_bytes"], ours["kv_bytes_per_token"], n, prompt_len, output_len)
            rounds.append(dict(kernel=name, output_tok_s=ours["output_tok_s"], seconds=ours["seconds"],
                               steps=ours["steps"], graph_steps=ours["graph_steps"],
                               truncated=ours["truncated_by_budget"], roofline_fraction=round(ours["output_tok_s"] / roof, 4)))
        emit({"check": "decode_end_to_end", "best": best, "rounds": rounds})
    return 0


if __name__ == "__main__":
    sys.exit(main())
