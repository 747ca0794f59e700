"""gpu_check.py's numerics checks: the device against the CPU in float32 token for token, bf16
and each quantized mode against CPU float32 logits (teacher-forced), with the bounds that
catch a broken kernel. Each check takes gpu_check.Run (its reference: CPU float32 greedy
runs of prompts with no near-tie)."""
from __future__ import annotations

import torch

import gpu_models
import gpu_quant
import gpu_speed
from gpu_report import BudgetExceeded, report
from pipeline import Engine, Request, SamplingParams
from pipeline.layers.quantization import weight_only as wq

MARGIN = 0.05   # nats: the least top-1/top-2 gap a chosen prompt's greedy steps may have
# bf16 logits against float32: mean |error| over the logits' standard deviation, and the
# share of positions with the same top token (a CPU in bf16 gives 0.007 and 0.97).
BF16_MEAN_REL_ERROR, BF16_TOP1_EQUAL = 0.02, 0.9


def greedy(engine: Engine, prompts: list[list[int]], tokens: int, **params) -> list:
    requests = [Request(str(i), prompt_token_ids=p, params=SamplingParams(temperature=0.0, max_tokens=tokens,
                                                                            ignore_eos=True, **params))
                for i, p in enumerate(prompts)]
    outs = {o.id: o for o in engine.generate(requests)}
    errors = [o.error for o in outs.values() if o.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[0]}")
    return [outs[str(i)] for i in range(len(prompts))]


def teacher_forced_logits(engine: Engine, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Each sequence's logits at every position but its last, [len - 1, vocab] float32 on the
    CPU: one request at a time asks for its prompt's logprobs, and compute_logits' call for
    those rows is kept."""
    kept, compute = [], engine.model.compute_logits

    def keeping(hidden):
        logits = compute(hidden)
        kept.append(logits.float().cpu())
        return logits
    engine.model.compute_logits = keeping
    try:
        out = []
        for ids in sequences:
            kept.clear()
            greedy(engine, [ids], 1, prompt_logprobs=0)
            out.append(next(t for t in kept if t.shape[0] == len(ids) - 1))
        return out
    finally:
        engine.model.compute_logits = compute


def share_before_first_difference(got: list[list[int]], want: list[list[int]]) -> float:
    agreed = sum(next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w)) for g, w in zip(got, want))
    return round(agreed / sum(len(w) for w in want), 3)


def check_numerics_float32(run) -> None:
    ref = run.reference
    if not ref["prompts"]:
        report("numerics_float32", "failed", reason=f"no prompt of {ref['candidates']} has every gap >= {MARGIN}")
        return
    # On a CPU the other side is the plain-PyTorch reference backend without packed weights.
    options = dict(attention_backend="reference", pack_weights=False) if run.device == "cpu" else {}
    engine = run.engine(device=run.device, dtype="float32", **options)
    outs = greedy(engine, ref["prompts"], len(ref["tokens"][0]), logprobs=2)
    got = [o.token_ids for o in outs]
    drift = max(abs(a.logprob - b.logprob) for o, want in zip(outs, ref["logprobs"])
                for a, b in zip(o.logprobs, want))
    report("numerics_float32", "passed" if got == ref["tokens"] else "failed", device=run.device,
           backend=type(engine.attention_backend).__name__, prompts=len(got), tokens=sum(map(len, got)),
           equal_sequences=sum(g == w for g, w in zip(got, ref["tokens"])), min_gap_nats=ref["min_gap"],
           prompts_tried=ref["candidates"], max_abs_logprob_diff=float(f"{drift:.3g}"),
           agreement=share_before_first_difference(got, ref["tokens"]))


def check_numerics_bf16(run) -> None:
    ref = run.reference
    engine = run.engine(device=run.device, dtype="bfloat16")
    logits = teacher_forced_logits(engine, [p + t[:-1] for p, t in zip(ref["prompts"], ref["tokens"])])
    spread = torch.cat(ref["logits"]).std().item()
    errors = torch.cat([(got - want).abs().flatten() for got, want in zip(logits, ref["logits"])])
    top1 = torch.cat([got.argmax(-1) == want.argmax(-1) for got, want in zip(logits, ref["logits"])])
    got = [o.token_ids for o in greedy(engine, ref["prompts"], len(ref["tokens"][0]))]
    rel = errors.mean().item() / spread
    ok = rel <= BF16_MEAN_REL_ERROR and top1.float().mean().item() >= BF16_TOP1_EQUAL
    report("numerics_bf16", "passed" if ok else "failed", device=run.device,
           backend=type(engine.attention_backend).__name__, positions=int(top1.numel()),
           logit_std=round(spread, 3), max_abs_logit_error=round(errors.max().item(), 4),
           mean_abs_logit_error=round(errors.mean().item(), 5), mean_error_over_std=round(rel, 4),
           max_error_over_std=round(errors.max().item() / spread, 4),
           top1_equal=round(top1.float().mean().item(), 4),
           greedy_agreement_before_first_difference=share_before_first_difference(got, ref["tokens"]))


# Quantized logits (bf16 activations) against CPU float32, as numerics_bf16: mean |error|
# over the logits' spread and the share of positions with the same top token. Measured with
# --quick on a CPU, where the same arithmetic runs (bf16 unquantized: 0.0068 and 0.96):
# fp8 0.068 and 0.85, w8a16 0.018 and 0.93, w4a16 (groups of 128) 0.20 and 0.39. A random
# model is the worst case for them (no outliers to keep, every weight counts; the LM head,
# unquantized, is scaled x40); the bounds are those numbers with room for bf16's own noise,
# there to catch a broken kernel (error ~1, top-1 ~0), not to rate the modes.
QUANT_MEAN_REL_ERROR = {"fp8": 0.095, "w8a16": 0.03, "w4a16": 0.28}
QUANT_TOP1_EQUAL = {"fp8": 0.75, "w8a16": 0.85, "w4a16": 0.28}


def check_numerics_quantized(run) -> None:
    ref = run.reference
    spread = torch.cat(ref["logits"]).std().item()
    modes, skipped = gpu_quant.runnable_modes(run.device)
    for mode, reason in skipped.items():
        report(f"numerics_{mode}", "skipped", reason=reason)
    for mode in modes:
        try:
            engine = run.engine(device=run.device, dtype="bfloat16", quantization=mode)
            logits = teacher_forced_logits(engine, [p + t[:-1] for p, t in zip(ref["prompts"], ref["tokens"])])
            got = [o.token_ids for o in greedy(engine, ref["prompts"], len(ref["tokens"][0]))]
        except BudgetExceeded:
            raise
        except Exception as e:   # one mode that raises must not hide the others
            report(f"numerics_{mode}", "error", device=run.device, error=f"{type(e).__name__}: {e}")
            gpu_speed.free_memory()
            continue
        errors = torch.cat([(got - want).abs().flatten() for got, want in zip(logits, ref["logits"])])
        top1 = torch.cat([got.argmax(-1) == want.argmax(-1) for got, want in zip(logits, ref["logits"])])
        rel, top1_share = errors.mean().item() / spread, top1.float().mean().item()
        layers = {type(m).__name__ for n, m in engine.model.named_modules() if n.endswith(("_proj",))}
        # An unquantized bf16 engine is inside every bound: the layers must be the mode's. On
        # CUDA the decode steps must replay from graphs (a capture that failed runs eagerly).
        graphs = run.device != "cuda" or engine.runner.graphs is not None
        ok = (rel <= QUANT_MEAN_REL_ERROR[mode] and top1_share >= QUANT_TOP1_EQUAL[mode]
              and layers == {wq.MODES[mode].__name__} and graphs)
        report(f"numerics_{mode}", "passed" if ok else "failed", device=run.device, layers=sorted(layers),
               decode_graphs_captured=graphs,
               weight_bytes=gpu_models.parameter_bytes(engine.model), positions=int(top1.numel()),
               mean_error_over_std=round(rel, 4), max_error_over_std=round(errors.max().item() / spread, 4),
               top1_equal=round(top1_share, 4), bounds=[QUANT_MEAN_REL_ERROR[mode], QUANT_TOP1_EQUAL[mode]],
               greedy_agreement_before_first_difference=share_before_first_difference(got, ref["tokens"]))
        del engine
        gpu_speed.free_memory()
