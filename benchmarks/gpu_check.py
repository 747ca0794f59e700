#!/usr/bin/env python3
"""Every check of the engine on one device, one JSON line each, then a summary line.

    python benchmarks/gpu_check.py --device cuda      # all checks (the day a GPU is lent)
    python benchmarks/gpu_check.py --device cpu       # the checks that apply to a CPU

Checks: greedy agreement of the device's default dtype with CPU float32 on the bundled
model; int8 and nf4 weights quantized right after Engine(); no host sync inside a decode
step's forward and one transfer per step; CUDA graph replay equal to eager; throughput of
a randomly initialised Llama-3.2-1B-shaped model in bf16 against Hugging Face continuous
batching (../shared/bench/peers.py --engine hf-cb). A check that does not apply to the
device, or needs what is not installed or not built yet, prints "skipped" with the reason.
Exit status 0 when no check failed.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from pipeline import Engine, EngineConfig, Request, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT.parent / "shared" / "bench" / "peers.py"
WORKLOAD = ROOT.parent / "shared" / "bench" / "workload.py"
PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are"]
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
# Llama-3.2-1B's shape (its 128k vocabulary replaced by the bundled tokenizer's 49k, so
# that generated ids detokenise).
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-5,
                rope_theta=500000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


def report(check: str, status: str, **fields) -> dict:
    line = {"check": check, "status": status, **fields}
    print(json.dumps(line), flush=True)
    return line


def greedy_tokens(engine: Engine, n: int) -> dict[str, list[int]]:
    requests = [Request(str(i), prompt=p, params=SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
                for i, p in enumerate(PROMPTS)]
    requests.append(Request("chat", messages=CAPITAL, params=SamplingParams(temperature=0, max_tokens=12)))
    return {o.id: o.token_ids for o in engine.generate(requests)}


def check_greedy_agreement(device: str) -> dict:
    """The device's default (auto) dtype against CPU float32: the share of tokens equal
    before the first difference (bf16 parts at float32 near-ties), and the chat answer."""
    reference_engine = Engine(EngineConfig(device="cpu", dtype="float32", num_kv_blocks=64))
    reference = greedy_tokens(reference_engine, 32)
    del reference_engine
    engine = Engine(EngineConfig(device=device, num_kv_blocks=64))
    got = greedy_tokens(engine, 32)
    agreed = sum(next((i for i, (a, b) in enumerate(zip(got[k], reference[k])) if a != b), len(reference[k]))
                 for k in reference)
    share = agreed / sum(len(v) for v in reference.values())
    answer = engine.tokenizer.decode(got["chat"], skip_special_tokens=True)
    ok = "Paris" in answer and share >= 0.5
    return report("greedy_agreement_with_cpu_float32", "passed" if ok else "failed", device=device,
                  dtype=str(engine.dtype).removeprefix("torch."), agreement=round(share, 3), chat=answer)


def check_quantized_at_load(device: str) -> list[dict]:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        return [report("quantized_at_load", "skipped", reason="bitsandbytes is not installed")]
    lines = []
    for mode, layer, weight_dtype in (("int8", "Linear8bitLt", torch.int8), ("nf4", "Linear4bit", torch.uint8)):
        engine = Engine(EngineConfig(device=device, quantization=mode, num_kv_blocks=16))
        swapped = [m for m in engine.model.modules() if type(m).__name__ == layer]
        wrong = sorted({str(m.weight.dtype) for m in swapped if m.weight.dtype != weight_dtype})
        training = sum(m.training for m in swapped)
        out = next(engine.generate([Request("q", messages=CAPITAL,
                                            params=SamplingParams(temperature=0, max_tokens=8))]))
        ok = bool(swapped) and not wrong and not training and out.error is None
        lines.append(report(f"{mode}_quantized_at_load", "passed" if ok else "failed", device=device,
                            layers=len(swapped), wrong_dtypes=wrong, in_training_mode=training,
                            text=out.text))
        del engine
    return lines


HOST_READS = ("item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__", "__array__")


def check_host_syncs(device: str) -> dict:
    """Each decode step: nothing read back in the forward, one read in all (the sampled
    tokens). On CUDA the forward also runs under torch.cuda.set_sync_debug_mode("error")."""
    engine = Engine(EngineConfig(device=device, num_kv_blocks=64))
    for i in range(4):
        engine.add_request(Request(f"s{i}", prompt="Tell me a story about the sea.",
                                   params=SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i or None,
                                                         max_tokens=8, ignore_eos=True)))
    engine.step()   # the prefill; what follows are decode steps
    counts: dict[str, int] = {}
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counting(name):
        def read(self, *args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return originals[name](self, *args, **kwargs)
        return read

    run_model, forward_reads, step_reads = engine.runner.run, [], []

    def strict_run(batch):
        before = sum(counts.values())
        if engine.device.type == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        try:
            return run_model(batch)
        finally:
            if engine.device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
            forward_reads.append(sum(counts.values()) - before)

    engine.runner.run = strict_run
    error = None
    try:
        for name in HOST_READS:
            setattr(torch.Tensor, name, counting(name))
        while engine.has_unfinished_requests:
            before = sum(counts.values())
            engine.step()
            step_reads.append(sum(counts.values()) - before)
    except RuntimeError as e:   # a sync under set_sync_debug_mode("error")
        error = str(e).splitlines()[0]
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    ok = error is None and max(forward_reads) == 0 and max(step_reads) <= 1
    return report("no_host_sync_in_decode_step", "passed" if ok else "failed", device=device,
                  steps=len(step_reads), forward_reads=max(forward_reads, default=0),
                  reads_per_step=max(step_reads, default=0), error=error)


def check_graph_replay(device: str) -> dict:
    """Decode steps replayed from CUDA graphs against the eager forward of the same step:
    every replayed step also runs eagerly first (same inputs, same cache), and the hidden
    states must agree to bf16 precision; greedy tokens of a graphed engine against an
    eager one are reported (bf16 near-ties may differ: split-KV depends on max_k)."""
    if device != "cuda":
        return report("cuda_graph_replay_equals_eager", "skipped", reason="CUDA graphs exist only on CUDA")
    engine = Engine(EngineConfig(device=device, num_kv_blocks=64))
    runner, graphs = engine.runner, engine.runner.graphs
    if graphs is None:
        return report("cuda_graph_replay_equals_eager", "failed", reason="no graphs were captured",
                      backend=engine.attention_backend.name)
    replay, diffs = graphs.replay, []

    def checked_replay(layout, to_device):
        eager = runner.forward(layout).clone()
        graphed = replay(layout, to_device)
        diffs.append((graphed.float() - eager.float()).abs().max().item())
        return graphed

    graphs.replay = checked_replay
    try:
        got = greedy_tokens(engine, 32)
    finally:
        graphs.replay = replay
    del engine
    eager_engine = Engine(EngineConfig(device=device, num_kv_blocks=64, cuda_graphs=False))
    expected = greedy_tokens(eager_engine, 32)
    same = sum(got[k] == expected[k] for k in expected)
    ok = bool(diffs) and max(diffs) <= 5e-2
    return report("cuda_graph_replay_equals_eager", "passed" if ok else "failed", device=device,
                  buckets=graphs.buckets, replayed_steps=len(diffs), max_abs_diff=max(diffs, default=None),
                  requests_with_equal_greedy_tokens=f"{same}/{len(expected)}")


def check_throughput(device: str, n: int) -> list[dict]:
    if device != "cuda":
        return [report("throughput_llama_1b_bf16_vs_hf_cb", "skipped",
                       reason="a GPU-sized model: measured on CUDA only")]
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.cli.bench import run_bench
    from pipeline.models.bundled import bundled_model_dir
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, requests = Path(tmp) / "llama-1b-shape", Path(tmp) / "w.jsonl"
        bundled = bundled_model_dir()
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=49152, **LLAMA_1B)
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(model_dir)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (bundled / name).exists():
                (model_dir / name).write_bytes((bundled / name).read_bytes())
        subprocess.run([sys.executable, str(WORKLOAD), "--model", str(model_dir), "--out", str(requests),
                        "--n", str(n), "--prompt", "16:256", "--output", "8:128", "--seed", "0"], check=True)
        ours = run_bench(str(requests), EngineConfig(model=str(model_dir), device="cuda", dtype="bfloat16"))
        lines.append(report("throughput_pipeline", "measured", **ours))
        peer = subprocess.run([sys.executable, str(PEERS), "--engine", "hf-cb", "--model", str(model_dir),
                               "--requests", str(requests)], capture_output=True, text=True)
        if peer.returncode != 0:
            lines.append(report("throughput_hf_cb", "failed", error=peer.stderr[-500:]))
            return lines
        theirs = json.loads(peer.stdout.strip().splitlines()[-1])
        lines.append(report("throughput_hf_cb", "measured", **theirs))
        ratio = ours["total_tok_s"] / theirs["total_tok_s"]
        lines.append(report("throughput_llama_1b_bf16_vs_hf_cb", "passed" if ratio >= 1 else "failed",
                            ratio=round(ratio, 2)))
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), required=True)
    ap.add_argument("--n", type=int, default=256, help="requests of the CUDA throughput workload")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"check": "device", "status": "failed", "reason": "no CUDA GPU visible"}))
        return 1
    start = time.perf_counter()
    lines = [check_greedy_agreement(a.device), *check_quantized_at_load(a.device), check_host_syncs(a.device),
             check_graph_replay(a.device), *check_throughput(a.device, a.n)]
    statuses = [line["status"] for line in lines]
    print(json.dumps({"summary": a.device, "passed": statuses.count("passed"), "failed": statuses.count("failed"),
                      "skipped": statuses.count("skipped"), "seconds": round(time.perf_counter() - start, 1)}))
    return 1 if "failed" in statuses else 0


if __name__ == "__main__":
    sys.exit(main())
