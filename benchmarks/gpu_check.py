#!/usr/bin/env python3
"""Every check of the engine on one device, one JSON line each, then a summary line that
always prints (exit 0 when no check failed or raised).

    python benchmarks/gpu_check.py --device cuda            # the day a GPU is lent (< 8 minutes)
    python benchmarks/gpu_check.py --device cpu --quick     # the same code on a CPU (about a minute)

Models are random Llamas built here from a config (gpu_models.py) with the bundled
tokenizer's files: no model wheel, nothing downloaded. Checks, each in its own try/except:
- environment: torch, the GPU, torch's varlen_attn entry and the attention backend that
  auto picks in bf16 (its start-up probe included), and what that choice logged.
- numerics_float32: the device in float32 against the CPU in float32, token for token, on
  prompts whose CPU greedy steps all have a top-1/top-2 log-probability gap of at least
  MARGIN (the numerics model's LM head is scaled so most do; a float32 difference in
  reduction order is ~1e-5 of that): any differing token is a bug.
- numerics_bf16: bf16 on the device against CPU float32: the logits of every position of
  the prompts followed by their float32 greedy tokens (teacher-forced, full vectors),
  error relative to the logits' spread; greedy agreement in bf16 reported.
- int8/nf4 quantized at load (only where bitsandbytes imports), no host read in a decode
  step's forward and one per step, CUDA graph replay equal to eager (CUDA only).
- paged_decode_kernel (gpu_attention.py): the Triton paged decode kernel that torch
  2.10/2.11's decode steps use, against the reference backend on a 1B-shaped layer in bf16,
  and its microseconds against gathering the pages for torch's packed varlen_attn (or
  against the paged FlashAttention-2 of torch >= 2.12), eagerly, and in a CUDA graph as
  decode steps run it. On a CPU under Triton's interpreter.
- pointwise_kernels (gpu_attention.py): the fused elementwise kernels (norms with the
  residual add, rotary + cache write, SiLU-and-multiply) against PyTorch's ops, 16
  1B-shaped layers at 256 rows captured in a CUDA graph each way: microseconds per layer.
- speed (gpu_speed.py): a Llama-3.2-1B-shaped random bf16 model, 256 sequences, 128-token
  prompts, 512-token outputs (--quick: 64 x 128 x 128 on CUDA; a small model on a CPU):
  output tok/s and its share of the HBM roofline (target 0.40), then Hugging Face
  continuous batching on the same GPU in bf16 (target: ours at least 5x), then a steady
  step's wall time against its graphed forward's GPU time (CUDA only); then a long job's
  refill (2,048 W1-shaped requests through 256 sequences) admitted one by one and in the
  engine's groups, A B A B: output tok/s and steps replayed from graphs (measured, no target);
  then overlapped steps off and on, A B A B on 256 x 128 x 128: the same greedy tokens (the
  check), and output tok/s each way.
- fp8, w8a16, w4a16 (PyTorch's own ops, pipeline/layers/quantization/weight_only.py; fp8 skipped below
  compute capability 8.9): each mode's layer on the device against its reference() (the
  CUDA formula in plain PyTorch, on the CPU, from the same quantized tensors), numerics_<mode>
  like numerics_bf16 (bf16 activations, the quantized engine against CPU float32), the
  matrix-product kernels of one 1B-shaped decoder layer against bf16 at 1, 16 and 256 rows
  (gpu_quant.py), and throughput_<mode> on throughput_pipeline's workload against its bf16
  number (fp8's target: 1.0x or more).
A wall-clock budget (--budget-s, 450 s) skips what no longer fits and stops a check that
overruns; the summary still prints. --only runs the named checks (CHECKS) alone.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # the engine, uninstalled

import torch  # noqa: E402

import gpu_attention  # noqa: E402
import gpu_models  # noqa: E402
from gpu_numerics import (MARGIN, check_numerics_bf16, check_numerics_float32, check_numerics_quantized,  # noqa: E402
                          greedy, teacher_forced_logits)
import gpu_quant  # noqa: E402
import gpu_speed  # noqa: E402
from gpu_report import REPORTED, BudgetExceeded, report  # noqa: E402
from pipeline import Engine, EngineConfig, Request, SamplingParams  # noqa: E402
from pipeline.kernels import cuda_kernels  # noqa: E402

SMALL = dict(kv_cache_gib=0.25, max_num_seqs=16,   # the numerics engines: small pools, few graph buckets
             batch_invariant=False)       # CUDA has no batch-invariant kernels yet
HOST_READS = ("item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__", "__array__")


class Run:
    """What the checks share: the device, the deadline, the models built once, the CPU reference."""

    def __init__(self, args, tmp: Path):
        self.device, self.quick, self.args, self.tmp = args.device, args.quick, args, tmp
        self.deadline = time.monotonic() + args.budget_s
        self.tokenizer = gpu_models.find_tokenizer(args.tokenizer)
        self._numerics, self._reference = None, None
        self.log_lines: list[str] = []

    def left(self) -> float:
        return self.deadline - time.monotonic()

    @property
    def numerics_model(self) -> Path:
        if self._numerics is None:
            self._numerics = gpu_models.build_model(self.tmp / "numerics", gpu_models.NUMERICS, self.tokenizer,
                                                    torch.float32, lm_head_scale=gpu_models.NUMERICS_LM_HEAD_SCALE)
        return self._numerics

    def engine(self, **options) -> Engine:
        return Engine(EngineConfig(model=str(self.numerics_model), **{**SMALL, **options}))

    @property
    def reference(self) -> dict:
        """CPU float32 greedy runs of random prompts; those with no near-tie are `chosen`."""
        if self._reference is None:
            rng = random.Random(0)
            n, tokens, keep = (16, 16, 4) if self.quick else (48, 32, 8)
            prompts = [[rng.randrange(100, gpu_models.VOCAB) for _ in range(rng.randint(8, 40))] for _ in range(n)]
            engine = self.engine(device="cpu", dtype="float32")
            outs = greedy(engine, prompts, tokens, logprobs=2)
            gaps = [min(e.top[0].logprob - e.top[1].logprob for e in o.logprobs)
                    for o in outs]
            chosen = [i for i, gap in enumerate(gaps) if gap >= MARGIN][:keep]
            self._reference = dict(prompts=[prompts[i] for i in chosen], tokens=[outs[i].token_ids for i in chosen],
                                   logprobs=[outs[i].logprobs for i in chosen], candidates=n,
                                   min_gap=round(min(gaps[i] for i in chosen), 4) if chosen else None,
                                   logits=teacher_forced_logits(engine, [prompts[i] + outs[i].token_ids[:-1]
                                                                         for i in chosen]))
            del engine
        return self._reference


def check_environment(run: Run) -> None:
    from pipeline.layers.attention import select
    from pipeline.layers.attention.flash_entry import entry_kind, installed_varlen_attn
    import transformers

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    fields = dict(torch=torch.__version__, transformers=transformers.__version__, python=sys.version.split()[0],
                  triton=triton_version, varlen_attn_entry=entry_kind(installed_varlen_attn()))
    if run.device == "cuda":
        fields.update(gpu=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()))
        shape = gpu_models.NUMERICS
        backend = select("auto", torch.device("cuda"), torch.bfloat16, torch.bfloat16,
                         (shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]))
        fields.update(attention_auto_bf16=type(backend).__name__, cuda_graphs=backend.supports_cuda_graphs,
                      triton_paged_decode=getattr(backend, "decode_kernel", None) is not None,
                      fused_pointwise_bf16=cuda_kernels.triton_pointwise(torch.zeros(1, device="cuda",
                                                                                dtype=torch.bfloat16)) is not None)
    report("environment", "info", **fields, attention_log=list(run.log_lines))


def check_quantized(run: Run) -> None:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as e:
        report("quantized_at_load", "skipped", reason=f"bitsandbytes does not import: {e}")
        return
    for mode, layer, weight_dtype in (("int8", "Linear8bitLt", torch.int8), ("nf4", "Linear4bit", torch.uint8)):
        engine = run.engine(device=run.device, quantization=mode)
        swapped = [m for m in engine.model.modules() if type(m).__name__ == layer]
        wrong = sorted({str(m.weight.dtype) for m in swapped if m.weight.dtype != weight_dtype})
        training = sum(m.training for m in swapped)
        out = greedy(engine, run.reference["prompts"][:2] or [[100, 200, 300]], 8)
        ok = bool(swapped) and not wrong and not training and all(len(o.token_ids) == 8 for o in out)
        report(f"{mode}_quantized_at_load", "passed" if ok else "failed", device=run.device,
               dtype=str(engine.dtype).removeprefix("torch."), layers=len(swapped), wrong_dtypes=wrong,
               in_training_mode=training)
        del engine


def check_host_syncs(run: Run) -> None:
    """Each decode step: nothing read back in the forward, one read in all (the sampled
    tokens). On CUDA the forward also runs under torch.cuda.set_sync_debug_mode("error")."""
    engine = run.engine(device=run.device)
    for i in range(4):
        engine.add_request(Request(f"s{i}", prompt_token_ids=[100 + i, 200, 300, 400, 500],
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

    def strict_run(batch, *rest):
        before = sum(counts.values())
        if engine.device.type == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        try:
            return run_model(batch, *rest)
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
    report("no_host_sync_in_decode_step", "passed" if ok else "failed", device=run.device,
           backend=type(engine.attention_backend).__name__, steps=len(step_reads),
           forward_reads=max(forward_reads, default=0), reads_per_step=max(step_reads, default=0), error=error)


def check_graph_replay(run: Run) -> None:
    """Decode steps replayed from CUDA graphs against the eager forward of the same step
    (same inputs, same cache): hidden states within bf16 precision. Where the auto backend
    has no graphs (torch 2.11's packed varlen), the reference backend's are checked."""
    if run.device != "cuda":
        report("cuda_graph_replay_equals_eager", "skipped", reason="CUDA graphs exist only on CUDA")
        return
    engine = run.engine(device="cuda", dtype="bfloat16", max_model_len=512)
    if not engine.attention_backend.supports_cuda_graphs:
        del engine
        engine = run.engine(device="cuda", dtype="bfloat16", max_model_len=512, attention_backend="reference")
    runner, graphs = engine.runner, engine.runner.graphs
    if graphs is None:
        report("cuda_graph_replay_equals_eager", "failed", reason="no graphs were captured")
        return
    replay, diffs = graphs.replay, []

    def checked_replay(layout, to_device, pending=None):
        eager = runner.forward(layout, pending).clone()
        graphed = replay(layout, to_device, pending)
        diffs.append((graphed.float() - eager.float()).abs().max().item())
        return graphed

    graphs.replay = checked_replay
    try:
        greedy(engine, run.reference["prompts"] or [[100, 200, 300]], 16)
    finally:
        graphs.replay = replay
    ok = bool(diffs) and max(diffs) <= 5e-2
    report("cuda_graph_replay_equals_eager", "passed" if ok else "failed",
           backend=type(engine.attention_backend).__name__, buckets=graphs.buckets, replayed_steps=len(diffs),
           max_abs_diff=max(diffs, default=None))


# The checks of the Triton kernels themselves: skipped, with the reason, where Triton does not import.
NEED_TRITON = {"paged_decode_kernel", "pointwise_kernels"}
CHECKS = [("environment", check_environment, 0), ("numerics_float32", check_numerics_float32, 20),
          ("numerics_bf16", check_numerics_bf16, 20), ("cuda_graph_replay_equals_eager", check_graph_replay, 30),
          ("no_host_sync_in_decode_step", check_host_syncs, 15),
          ("paged_decode_kernel", gpu_attention.check_decode_kernel, 15),
          ("pointwise_kernels", gpu_attention.check_pointwise_kernels, 10),
          ("throughput_pipeline", gpu_speed.check_speed, 90),
          ("throughput_hf_continuous_batching", gpu_speed.check_hf_peer, 80),
          ("decode_step_split", gpu_speed.check_step_split, 20),
          ("refill_admission_groups", gpu_speed.check_refill, 60),
          ("overlapped_steps", gpu_speed.check_overlap, 40),
          ("quantized_at_load", check_quantized, 30),
          ("quantized_kernels_equal_reference", gpu_quant.check_reference, 10),
          ("numerics_quantized", check_numerics_quantized, 25),
          ("quantized_matmul_kernels", gpu_quant.check_kernels, 20),
          ("throughput_quantized", gpu_quant.check_throughput, 60)]


class LogLines(logging.Handler):
    def __init__(self, lines: list[str]):
        super().__init__(logging.INFO)
        self.lines = lines

    def emit(self, record):
        self.lines.append(record.getMessage())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), required=True)
    ap.add_argument("--quick", action="store_true", help="smaller workloads (about a minute on a CPU)")
    ap.add_argument("--budget-s", type=float, default=450.0, help="wall-clock budget of all checks")
    ap.add_argument("--only", help="comma-separated check names (CHECKS) to run, the rest left out; "
                                   "throughput_quantized needs throughput_pipeline")
    ap.add_argument("--tokenizer", help="a folder with tokenizer.json  [default: .gpu-carry/tokenizer, else the "
                                        "converted bundled model]")
    args = ap.parse_args()
    if args.device == "cpu":   # Triton kernels run interpreted (chosen when one is defined: before any import)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    start = time.monotonic()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    def overrun(*_):
        raise BudgetExceeded(f"over the wall-clock budget of {args.budget_s:.0f} s")
    signal.signal(signal.SIGALRM, overrun)
    # A check that overruns its estimate is stopped; every 5 s again, should code that catches
    # Exception (a fallback probe, a request's tokenisation) swallow the first.
    signal.setitimer(signal.ITIMER_REAL, args.budget_s + 15, 5)
    try:
        if args.device == "cuda" and not torch.cuda.is_available():
            report("device", "failed", reason="no CUDA GPU visible")
            return 1
        with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
            run_checks(Run(args, Path(tmp)))
    except BudgetExceeded as e:
        report("budget", "error", error=str(e))
    except Exception as e:   # before any check: no tokenizer, no temporary folder, ...
        report("setup", "error", error=f"{type(e).__name__}: {e}"[:400])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        statuses = [line["status"] for line in REPORTED]
        print(json.dumps({"summary": args.device, "quick": args.quick,
                          **{s: statuses.count(s) for s in ("passed", "failed", "error", "skipped", "measured")},
                          "seconds": round(time.monotonic() - start, 1)}), flush=True)
    return 1 if {"failed", "error"} & set(statuses) else 0


def triton_missing() -> str | None:
    """Why Triton cannot be imported (a plain `pip install -e .` on a CPU has none), or None."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"{type(e).__name__}: {e}"
    return None


def run_checks(run: Run) -> None:
    attention_log = logging.getLogger("pipeline.layers.attention")
    attention_log.setLevel(logging.INFO)
    attention_log.addHandler(LogLines(run.log_lines))
    only = set(run.args.only.split(",")) if run.args.only else {name for name, _, _ in CHECKS}
    if unknown := only - {name for name, _, _ in CHECKS}:
        raise ValueError(f"--only: no check named {', '.join(sorted(unknown))}")
    for i, (name, check, need_s) in enumerate(CHECKS):
        if name not in only:
            continue
        if name in NEED_TRITON and (missing := triton_missing()) is not None:
            report(name, "skipped", reason=f"Triton does not import ({missing}): the check runs its kernels "
                                           "(`pip install triton`; torch's CUDA wheels bring it)")
            continue
        if run.left() < need_s:
            report(name, "skipped", reason=f"wall-clock budget: {run.left():.0f} s left, it needs about {need_s} s")
            continue
        try:
            check(run)
        except BudgetExceeded as e:
            signal.setitimer(signal.ITIMER_REAL, 0)   # stopped: no repeat while the rest is reported
            report(name, "error", error=str(e))
            for later, _, _ in CHECKS[i + 1:]:
                if later in only:
                    report(later, "skipped", reason=str(e))
            return
        except Exception as e:
            report(name, "error", error=f"{type(e).__name__}: {e}"[:400],
                   where=traceback.format_exc().strip().splitlines()[-3:])
        finally:
            gpu_speed.free_memory()


if __name__ == "__main__":
    sys.exit(main())
