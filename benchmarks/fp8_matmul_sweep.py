#!/usr/bin/env python3
"""Choose fp8_matmul_triton's launches on a GPU, and measure what fp8 then buys end to end.
One JSON line each:

    python benchmarks/fp8_matmul_sweep.py [--tokenizer DIR] [--budget-s 240]

(Without a GPU it runs the same code on tiny sizes under Triton's interpreter: a smoke test
of this script, its numbers mean nothing.)

- `fp8_matmul_config`: for each row count (1, 16, 64, 128, 256) and each candidate launch (tile
  M x N x K, warps, pipeline stages), the microseconds of a Llama-3.2-1B layer's four
  linears (q/k/v, o, gate/up, down) through the Triton product, its largest error against
  `_scaled_mm` on the same fp8 tensors (relative to their largest output), and beside it
  `_scaled_mm` (row-wise scales, as Fp8Linear runs it) and bf16 cuBLAS. Each kernel is
  timed as a decode step runs it (20 calls in a CUDA graph, median of 5 replays), cycling
  through enough copies of the weights that none is still in L2 when it is read again
  (the H200's 50 MB would hold a whole fp8 layer, and flatter every weight-bound kernel).
- `fp8_matmul_best`: per row bound of fp8_matmul_triton.LAUNCHES, the fastest correct
  launch of the row counts it holds, with the layer's microseconds each way.
- `fp8_end_to_end`: gpu_speed.run_pipeline's workload (256 x 128-token prompts, 512 greedy
  tokens each, the 1B-shaped random model), bf16, fp8 through `_scaled_mm`, and fp8
  through the best launches, twice each in that order: output tok/s and the ratio to the
  round's bf16; then the fp8 step's GPU kernels by name (gpu_speed.step_split).
"""
from __future__ import annotations

import argparse
import json
import math
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

import torch.nn.functional as F  # noqa: E402

import gpu_models  # noqa: E402
import gpu_speed  # noqa: E402
from gpu_quant import graphed_us, layer_shapes  # noqa: E402
from pipeline.kernels import fp8_matmul_triton as fp8mm  # noqa: E402
from pipeline.layers.quantization import weight_only as wq  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
ROWS = (1, 16, 64, 128, 256) if CUDA else (1, 16)
L2_BYTES = 100 << 20   # twice the H200's L2: the weight copies one timing cycles through
Launch = fp8mm.Launch
CANDIDATES = {   # each compiles once (a second or two): 23 in all, each for sm_90 without spills
    "small": [Launch(16, n, k, 4, 4) for n in (32, 64, 128) for k in (128, 256)]
             + [Launch(64, 32, 256, 4, 4), Launch(64, 64, 128, 4, 4)],
    "mid": [Launch(64, n, k, 4, 3) for n in (32, 64, 128) for k in (128, 256)],
    "large": [Launch(m, n, 128, w, s) for m, n, w in ((64, 64, 4), (64, 128, 4), (64, 128, 8), (128, 64, 4),
                                                      (128, 128, 8), (64, 256, 8)) for s in (3, 4)],
}
ERROR_BOUND = 1e-2   # against _scaled_mm: bf16 rounding of the output, not a wrong kernel


def emit(line: dict) -> None:
    print(json.dumps(line), flush=True)


def candidates(rows: int) -> list[Launch]:
    if not CUDA:
        return [Launch(16, 32, 32, 4, 2), Launch(16, 64, 64, 4, 2)]
    if rows <= 16:
        return CANDIDATES["small"]
    tried = CANDIDATES["mid"] + (CANDIDATES["large"][:2] if rows <= 64 else CANDIDATES["large"])
    return list(dict.fromkeys(tried))   # each once


class Linear:
    """One of the layer's linears: its fp8 weight (copies of it, for L2) and its bf16 twin."""

    def __init__(self, k: int, n: int):
        if not CUDA:
            k, n = min(k, 64), min(n, 96)
        w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * 0.02
        w8, ws = wq.quantize_fp8_rows(w)
        copies = max(1, math.ceil(L2_BYTES / w8.numel())) if CUDA else 1
        self.fp8 = [(w8.clone(), ws.reshape(1, -1).contiguous()) for _ in range(copies)]
        self.bf16 = [w.clone() for _ in range(max(1, copies // 2))]
        self.k = k

    def timed(self, rows: int, launch: Launch | None) -> tuple[dict, float]:
        """Microseconds of the Triton product (launch), _scaled_mm and bf16 at `rows` rows,
        and the Triton product's error against _scaled_mm."""
        x = torch.randn(rows, self.k, device=DEVICE, dtype=torch.bfloat16)
        x8, xs = wq.quantize_fp8_rows(x)
        turn = [0]

        def cycling(weights, call):
            def run():
                turn[0] += 1
                return call(weights[turn[0] % len(weights)])
            return run
        out = {}
        if launch is not None:
            out["triton"] = graphed_us(cycling(self.fp8, lambda w: fp8mm.fp8_matmul(x8, w[0], xs, w[1], torch.bfloat16,
                                                                                    launch)), DEVICE)
        else:
            out["scaled_mm"] = graphed_us(cycling(self.fp8, lambda w: torch._scaled_mm(
                x8, w[0].t(), scale_a=xs, scale_b=w[1], out_dtype=torch.bfloat16)), DEVICE)
            out["bf16"] = graphed_us(cycling(self.bf16, lambda w: F.linear(x, w)), DEVICE)
        error = 0.0
        if launch is not None:
            w8, ws = self.fp8[0]
            want = torch._scaled_mm(x8, w8.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16).float()
            got = fp8mm.fp8_matmul(x8, w8, xs, ws, torch.bfloat16, launch).float()
            error = ((got - want).abs().max() / want.abs().max().clamp(min=1e-30)).item()
        return out, error


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", help="a folder with tokenizer.json (see gpu_models.find_tokenizer)")
    ap.add_argument("--budget-s", type=float, default=240.0, help="wall-clock budget")
    args = ap.parse_args()
    deadline = time.monotonic() + args.budget_s
    linears = {name: Linear(k, n) for name, (k, n) in layer_shapes(gpu_models.LLAMA_1B).items()}

    layer_us: dict[int, dict[Launch, float]] = {}
    for rows in ROWS:
        base = {"scaled_mm": 0.0, "bf16": 0.0}
        for linear in linears.values():
            times, _ = linear.timed(rows, None)
            for key in base:
                base[key] += times[key]
        emit({"check": "fp8_matmul_baseline", "rows": rows, **{f"{k}_us": round(v, 2) for k, v in base.items()}})
        layer_us[rows] = {}
        for launch in candidates(rows):
            if time.monotonic() > deadline - 90:
                emit({"check": "fp8_matmul_config", "rows": rows, "skipped": "budget"})
                break
            try:
                total, worst = 0.0, 0.0
                for linear in linears.values():
                    times, error = linear.timed(rows, launch)
                    total, worst = total + times["triton"], max(worst, error)
            except Exception as e:   # a launch that does not compile (shared memory, registers)
                emit({"check": "fp8_matmul_config", "rows": rows, "launch": launch.__dict__,
                      "error": f"{type(e).__name__}: {e}"[:300]})
                continue
            if worst <= ERROR_BOUND:
                layer_us[rows][launch] = total
            emit({"check": "fp8_matmul_config", "rows": rows, "launch": launch.__dict__, "us": round(total, 2),
                  "over_scaled_mm": round(base["scaled_mm"] / total, 3), "over_bf16": round(base["bf16"] / total, 3),
                  "max_error": float(f"{worst:.3g}")})
        layer_us[rows]["base"] = base

    # Each bound of LAUNCHES gets the launch fastest at the largest row count it holds that was measured.
    best = {}
    for bound in sorted(fp8mm.LAUNCHES):
        measured = [r for r in ROWS if r <= bound and len(layer_us.get(r, {})) > 1]
        if not measured:
            continue
        rows = measured[-1]
        timed = {k: v for k, v in layer_us[rows].items() if k != "base"}
        launch = min(timed, key=timed.get)
        best[bound] = launch
        base = layer_us[rows]["base"]
        emit({"check": "fp8_matmul_best", "bound": bound, "rows": rows, "launch": launch.__dict__,
              "us": round(timed[launch], 2), "scaled_mm_us": round(base["scaled_mm"], 2), "bf16_us": round(base["bf16"], 2),
              "default_us": round(timed[fp8mm.LAUNCHES[bound]], 2) if fp8mm.LAUNCHES[bound] in timed else None})
    del linears
    gpu_speed.free_memory()

    with tempfile.TemporaryDirectory(prefix="fp8-sweep-") as tmp:
        shape, dtype = (gpu_models.LLAMA_1B, torch.bfloat16) if CUDA else (gpu_models.SMALL_SPEED, torch.float32)
        model_dir = gpu_models.build_model(Path(tmp) / "speed", shape, gpu_models.find_tokenizer(args.tokenizer),
                                           dtype, device=DEVICE)
        n, prompt_len, output_len = (256, 128, 512) if CUDA else (4, 16, 8)
        prompts = gpu_speed.workload(n, prompt_len)
        defaults, product = dict(fp8mm.LAUNCHES), wq.Fp8Linear.triton_product
        fp8mm.LAUNCHES.update(best)   # what the engine's fp8 layers launch from here on
        rounds = []
        for name, quantization, triton_product in [("bf16", "none", True), ("fp8_scaled_mm", "fp8", False),
                                                   ("fp8_triton_best", "fp8", True)] * 2:
            if time.monotonic() > deadline - 20:
                rounds.append({"run": name, "skipped": "budget"})
                continue
            wq.Fp8Linear.triton_product = triton_product
            try:
                ours = gpu_speed.run_pipeline(model_dir, DEVICE, prompts, output_len, deadline, quantization=quantization)
            finally:
                wq.Fp8Linear.triton_product = product
            roof = gpu_speed.roofline_output_tok_s(ours["weight_bytes"], ours["kv_bytes_per_token"], n, prompt_len,
                                                   output_len)
            rounds.append(dict(run=name, output_tok_s=ours["output_tok_s"], seconds=ours["seconds"],
                               graph_steps=ours["graph_steps"], eager_steps_s=ours["eager_steps_s"],
                               truncated=ours["truncated_by_budget"], roofline_fraction=round(ours["output_tok_s"] / roof, 4)))
        for i, r in enumerate(rounds):
            bf16 = next((b for b in reversed(rounds[:i + 1]) if b.get("run") == "bf16" and "output_tok_s" in b), None)
            if bf16 and "output_tok_s" in r:
                r["over_bf16"] = round(r["output_tok_s"] / bf16["output_tok_s"], 3)
        emit({"check": "fp8_end_to_end", "best": {b: l.__dict__ for b, l in best.items()}, "defaults":
              {b: l.__dict__ for b, l in defaults.items()}, "rounds": rounds})
        if CUDA and time.monotonic() < deadline - 15:
            wq.Fp8Linear.triton_product = True   # the best launches' step
            try:
                emit({"check": "fp8_step_split", **gpu_speed.step_split(model_dir, DEVICE, prompts, output_len, "fp8")})
            finally:
                wq.Fp8Linear.triton_product = product
    return 0


if __name__ == "__main__":
    sys.exit(main())
