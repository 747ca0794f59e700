#!/usr/bin/env python3
"""Host time of a decode step at many sequences: what the engine's Python does around the
forward and the sampler, which a GPU would otherwise wait on.

    python benchmarks/host_step.py [--seqs 256] [--steps 48] [--rounds 3] [--stub-model]

A tiny random Llama (the bundled tokenizer's 49,152 tokens, hidden 64) on the CPU, `seqs`
requests of 128-token prompts decoding together; once every prompt is computed, each
step's wall time is split into the model runner (inputs, forward), the sampler, and the
rest (scheduling, appending tokens, detokenising, stop strings, outputs): the host's own
share, the figure the GPU path needs far below its ~10 ms decode step. Three workloads:
greedy, sampled (temperature 1), and greedy with a stop string (incremental detokenising).
One JSON line per workload and round, medians in ms.

--stub-model replaces the model's forward, its logits and the sampler's draw with
precomputed tensors (the attention metadata and input tensors are still built): each
step is then the host's own work alone, the figure overlapped steps must keep below the
GPU's step time.

glibc serves each allocation over 32 MB (here the [256, 49,152] float32 logits) with a fresh
mmap and unmaps it when freed, so on a CPU every step page-faults the logits in again and
pays for it in the model runner and at the step's end: greedy, 46-48 against 34-35 ms a
step and a host share of 6.3-6.7 against 2.0-2.1 ms on an AVX-512 EPYC. A GPU's logits
live on the device, so the benchmark keeps freed memory in the heap
(pipeline.host_memory.keep_freed_memory) to time what a GPU's host would do;
--glibc-defaults times it with glibc's own settings.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from gpu_models import build_model, find_tokenizer
from pipeline import EngineConfig, Request
from pipeline.host_memory import keep_freed_memory
from pipeline.engine.engine import Engine
from pipeline.sampling_params import SamplingParams

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2)
WORKLOADS = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=1.0),
             "stop string": dict(temperature=0.0, stop=["<never-appears>"])}


class Timed:
    """Wraps a bound method, adding its wall time to `spent`."""

    def __init__(self, method):
        self.method, self.spent = method, 0.0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.method(*args, **kwargs)
        finally:
            self.spent += time.perf_counter() - start


def stub_model(engine: Engine, seqs: int) -> None:
    """The forward, the logits and the draw return precomputed tensors of the right shapes."""
    hidden = torch.zeros(4096, engine.model.args.hidden_size)
    logits = torch.zeros(seqs, 16)
    tokens = torch.randint(100, 40000, (seqs,), generator=torch.Generator().manual_seed(0))
    engine.model.forward = lambda input_ids, positions, meta: hidden[:len(input_ids)]
    engine.model.compute_logits = lambda rows: logits[:len(rows)]
    engine.sampler.draw = lambda step_logits, *args, **kwargs: tokens[:len(step_logits)]


def measure(engine: Engine, seqs: int, steps: int, params: dict) -> dict:
    rng = random.Random(0)
    for i in range(seqs):
        prompt = [rng.randrange(100, 40000) for _ in range(128)]
        refused = engine.add_request(Request(f"r{i}", prompt_token_ids=prompt,
                                             params=SamplingParams(max_tokens=steps + 16, ignore_eos=True, **params)))
        if refused:   # else the steps below would time an engine with nothing to do
            raise RuntimeError(f"request r{i} refused: {refused[0].error}")
    while any(s.num_computed_tokens < len(s.prompt_token_ids) for s in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()
    runner, sampler = Timed(engine.runner.run), Timed(engine.sampler.draw)   # draw: serial and overlapped
    engine.runner.run, engine.sampler.draw = runner, sampler
    totals, runs, samples = [], [], []
    try:
        for _ in range(steps):
            before_run, before_sample = runner.spent, sampler.spent
            start = time.perf_counter()
            engine.step()
            totals.append(time.perf_counter() - start)
            runs.append(runner.spent - before_run)
            samples.append(sampler.spent - before_sample)
    finally:
        engine.runner.run, engine.sampler.draw = runner.method, sampler.method   # unwrapped (a stub stays)
        engine.scheduler.abort_all()
    ms = lambda values: round(1e3 * statistics.median(values), 3)
    return {"seqs": seqs, "step_ms": ms(totals), "runner_ms": ms(runs), "sampler_ms": ms(samples),
            "host_ms": ms([t - r - s for t, r, s in zip(totals, runs, samples)])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokenizer", help="a folder with tokenizer.json (default: the bundled model's)")
    parser.add_argument("--glibc-defaults", action="store_true",
                        help="leave glibc's malloc as it is (large blocks mapped afresh every step)")
    parser.add_argument("--stub-model", action="store_true",
                        help="precomputed forward, logits and draw: time the host's own work alone (greedy only)")
    parser.add_argument("--overlap-steps", action="store_true",
                        help="overlapped steps, as on CUDA (pipeline/engine/step_in_flight.py): what their own bookkeeping adds")
    args = parser.parse_args()
    if not args.glibc_defaults and not keep_freed_memory():
        raise SystemExit("glibc's mallopt refused (not glibc?): pass --glibc-defaults")
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "tiny", TINY, find_tokenizer(args.tokenizer), torch.float32)
        engine = Engine(EngineConfig(model=str(model), device="cpu", dtype="float32", max_num_seqs=args.seqs,
                                     max_num_batched_tokens=4096, kv_cache_gib=0.5,
                                     overlap_steps=args.overlap_steps))
        workloads = WORKLOADS
        if args.stub_model:
            stub_model(engine, args.seqs)
            workloads = {"greedy": WORKLOADS["greedy"]}   # the stubbed draw samples nothing
        for round_ in range(1, args.rounds + 1):
            for name, params in workloads.items():
                print(json.dumps({"workload": name, "round": round_, **measure(engine, args.seqs, args.steps, params)}),
                      flush=True)


if __name__ == "__main__":
    main()
