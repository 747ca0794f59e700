#!/usr/bin/env python3
"""Measure each quantization mode on this machine: weight memory, throughput, quality.

    python benchmarks/quantization.py [--model DIR] [--requests w1.jsonl] [--n 16] [--dtype float32] [--modes none,w8a8]
    python benchmarks/quantization.py --kv-cache ...    # the KV-cache rows instead
    python benchmarks/quantization.py --linears         # int8 GEMM candidates per layer shape

Quality is perplexity of the model on a fixed English text (teacher forcing through our
own model code) and greedy agreement with float32: the share of greedy tokens, over a
few prompts, that equal float32's before the first difference.
With --kv-cache it compares the KV-cache dtypes (auto, int8) on float32 MKL-packed
weights, and the perplexity is computed in chunks of one block whose attention reads
every key and value back from the cache (in one unchunked pass a prompt's attention
uses its fresh keys and values, so a quantized cache would not show).
With --linears it times each CPU int8 candidate against float32 on the bundled model's
layer shapes (interleaved, the fastest of many rounds: the machine is shared) and prints
one JSON line per shape and row count, with each candidate's error against float32.
Prints one JSON line per mode; docs/performance.md's quantization table comes from this script.
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch

from pipeline import Engine, EngineConfig, Request, SamplingParams
from pipeline.layers.attention.cpu_paged import AttentionMetadata, PrefillChunk, cache_rows
from cli.bench import read_workload
from pipeline.layers.quantization.int8_linear import Int8Linear
from pipeline.layers.packed_linear import PackedLinear
from pipeline.layers.quantization.weight_only import quantize_int8_rows

TEXT = ("The history of the city begins in the first century, when a small settlement grew up on the "
        "banks of the river. Over the following centuries it became an important market town, and its "
        "bridge carried most of the trade between the northern and southern parts of the country. In the "
        "nineteenth century the arrival of the railway brought new industries, and the population grew "
        "quickly as people moved from the countryside to work in the factories. Today the city is known "
        "for its university, its museums and the old streets around the cathedral.")
PROMPTS = ["What is the capital of France?", "Write a short poem about the sea.",
           "Explain what a CPU does in one paragraph.", "List three fruits that are red."]


def weight_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type == "meta":
            continue
        key = t.data_ptr() if t.layout == torch.strided else id(t)   # oneDNN's packed weights have no storage
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    for m in model.modules():  # bitsandbytes keeps quantization scales beside the weight
        state = getattr(getattr(m, "weight", None), "quant_state", None)
        if state is not None and getattr(state, "absmax", None) is not None:
            total += state.absmax.numel() * state.absmax.element_size()
        scb = getattr(getattr(m, "weight", None), "SCB", None)
        if scb is not None:
            total += scb.numel() * scb.element_size()
        if isinstance(m, Int8Linear):   # fbgemm's packed weight is no tensor
            total += m.weight_bytes
    return total


@torch.inference_mode()
def perplexity(engine: Engine, text: str, through_cache: bool = False) -> float:
    ids = engine.tokenizer.encode(text)
    n = len(ids)
    bs = engine.block_size
    num_blocks = -(-n // bs)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks >= num_blocks
    kv = engine.runner.kv_cache
    chunk = bs if through_cache else n
    logits = []
    for start in range(0, n, chunk):   # blocks 0.. are free in a fresh engine: slot = position
        end = min(start + chunk, n)
        slots = torch.arange(start, end)
        if through_cache:   # attend to every key so far, read back from the cache
            q_pos = torch.arange(start, end).unsqueeze(1)
            prefill = PrefillChunk(0, end - start, torch.arange(-(-end // bs)), torch.arange(end).unsqueeze(0) <= q_pos)
        else:
            prefill = PrefillChunk(0, end - start, None, None)
        rows = torch.from_numpy(cache_rows(slots.numpy(), kv.num_kv_heads, kv.block_size))
        meta = AttentionMetadata(cache_rows=rows, decode=None, prefills=[prefill])
        logits.append(engine.model.compute_logits(engine.model(torch.tensor(ids[start:end]), slots, meta)))
    nll = torch.nn.functional.cross_entropy(torch.cat(logits)[:-1], torch.tensor(ids[1:]))
    return math.exp(nll.item())


def greedy(engine: Engine, n_tokens: int) -> dict[str, list[int]]:
    reqs = [Request(str(i), messages=[{"role": "user", "content": p}],
                    params=SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True))
            for i, p in enumerate(PROMPTS)]
    return {o.id: o.token_ids for o in engine.generate(reqs)}


LINEAR_SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
LINEAR_ROWS = (1, 8, 64, 300, 1024)


def linear_candidates(linear: torch.nn.Linear) -> dict:
    """name -> function of x [rows, in] float32, each multiplying by linear's weight."""
    weight = linear.weight.detach()
    q, scale = quantize_int8_rows(weight)
    qweight = torch._make_per_channel_quantized_tensor(q, scale.double(), torch.zeros(len(scale), dtype=torch.long), 0)
    candidates = {"float32 MKL-packed": PackedLinear(linear),
                  "float32 F.linear": lambda x: torch.nn.functional.linear(x, weight),
                  "w8a8 Int8Linear (ours)": Int8Linear(linear)}
    for engine in ("x86", "onednn"):   # PyTorch's dynamic path: one activation range per batch
        torch.backends.quantized.engine = engine
        packed = torch.ops.quantized.linear_prepack(qweight, None)
        candidates[f"linear_dynamic {engine}"] = lambda x, p=packed: torch.ops.quantized.linear_dynamic(x, p, True)
    torch.backends.quantized.engine = "x86"
    onednn_packed = torch.ops.onednn.qlinear_prepack(q, [1024, linear.in_features])

    def onednn_qlinear(x):   # uint8 activations, one dynamic range over the whole batch
        lo, hi = torch.aminmax(x)
        s = max(hi.item() - lo.item(), 1e-8) / 255
        zp = int(round(-lo.item() / s))
        xq = torch.clamp(torch.round(x / s) + zp, 0, 255).to(torch.uint8)
        return torch.ops.onednn.qlinear_pointwise(xq, s, zp, onednn_packed, scale, torch.zeros(len(scale), dtype=torch.long),
                                                  None, 1.0, 0, torch.float32, "none", [], "")
    candidates["onednn qlinear_pointwise"] = onednn_qlinear
    qt = q.t().contiguous()

    def int_mm(x):   # activations per token, int32 out
        top = x.abs().amax(1, keepdim=True).clamp(min=1e-12) / 127
        return torch._int_mm(torch.round(x / top).to(torch.int8), qt).float() * top * scale
    candidates["torch._int_mm"] = int_mm
    candidates["torch._weight_int8pack_mm (weight-only)"] = lambda x: torch._weight_int8pack_mm(x, q, scale)
    return candidates


@torch.inference_mode()
def time_linears(rounds: int = 5) -> None:
    torch.manual_seed(0)
    for shape, (k, n) in LINEAR_SHAPES.items():
        candidates = linear_candidates(torch.nn.Linear(k, n, bias=False))
        for rows in LINEAR_ROWS:
            x = torch.randn(rows, k)
            expected = candidates["float32 F.linear"](x)
            best = {name: math.inf for name in candidates}
            calls = max(1, int(3e7 // (rows * k * n)))   # a timing of at least ~30M multiply-adds
            for _ in range(rounds):   # interleaved: a slow spell of the machine hits every candidate
                for name, fn in candidates.items():
                    fn(x)
                    start = time.perf_counter()
                    for _ in range(calls):
                        fn(x)
                    best[name] = min(best[name], (time.perf_counter() - start) / calls)
            errors = {name: ((fn(x) - expected).norm() / expected.norm()).item() for name, fn in candidates.items()}
            print(json.dumps({"shape": f"{shape} {k}->{n}", "rows": rows,
                              "us": {name: round(t * 1e6, 1) for name, t in best.items()},
                              "vs_mkl": {name: round(best["float32 MKL-packed"] / t, 2) for name, t in best.items()},
                              "error": {name: float(f"{e:.2g}") for name, e in errors.items()}}), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests")
    ap.add_argument("--n", type=int, default=16, help="requests of the workload to time")
    ap.add_argument("--dtype", default="float32", help="compute dtype (docs/performance.md's table: float32)")
    ap.add_argument("--kv-cache", action="store_true", help="compare the KV-cache dtypes instead")
    ap.add_argument("--modes", help="comma-separated quantization modes to run (default: none unpacked and "
                                    "packed, int8, nf4, w8a8); the first is the agreement's reference")
    ap.add_argument("--linears", action="store_true", help="time the int8 GEMM candidates per layer shape")
    a = ap.parse_args()
    if a.linears:
        return time_linears()
    if not a.requests:
        ap.error("--requests is needed (except with --linears)")
    workload = read_workload(a.requests)[:a.n]
    reference = None
    # "none" twice: plain float32 weights, then MKL-packed (the CPU float32 default).
    modes = [("none", False, "auto"), ("none", True, "auto"), ("int8", False, "auto"), ("nf4", False, "auto"),
             ("w8a8", False, "auto")]
    if a.modes:   # none packed as the CPU default has it; the others pack what they pack themselves
        modes = [(mode, mode == "none", "auto") for mode in a.modes.split(",")]
    if a.kv_cache:
        modes = [("none", True, "auto"), ("none", True, "int8")]
    for mode, packed, kv_dtype in modes:
        engine = Engine(EngineConfig(model=a.model, dtype=a.dtype, quantization=mode, pack_weights=packed,
                                     kv_cache_dtype=kv_dtype))
        ppl = perplexity(engine, TEXT, through_cache=a.kv_cache)
        tokens = greedy(engine, 32)
        if reference is None:
            reference = tokens
        agree = sum(next((i for i, (x, y) in enumerate(zip(tokens[k], reference[k])) if x != y), len(tokens[k]))
                    for k in reference) / sum(len(v) for v in reference.values())
        start = time.perf_counter()
        outs = list(engine.generate(workload))
        seconds = time.perf_counter() - start
        total = sum(o.prompt_tokens + o.output_tokens for o in outs)
        print(json.dumps({"quantization": mode + (" (packed)" if packed else ""), "kv_cache_dtype": kv_dtype,
                          "kv_blocks": engine.block_manager.num_blocks,
                          "weight_mib": round(weight_bytes(engine.model) / 2**20, 1),
                          "total_tok_s": round(total / seconds, 1), "perplexity": round(ppl, 3),
                          "greedy_agreement": round(agree, 3)}), flush=True)
        del engine


if __name__ == "__main__":
    main()
