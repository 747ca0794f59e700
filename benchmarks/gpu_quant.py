"""gpu_check.py's lines for PyTorch's own quantization modes (fp8, w8a16, w4a16;
pipeline/layers/quantization/weight_only.py): the matrix-product kernels one decoder layer of the
Llama-3.2-1B shape runs, timed against bf16 at 1, 16 and 256 rows, and the engine's
throughput with each mode on the workload of `throughput_pipeline` (256 sequences on
CUDA), against that line's bf16 number.

fp8 is expected to beat bf16 where the GPU has FP8 tensor cores (twice bf16's rate on
Hopper): `throughput_fp8` passes at a ratio of 1.0 or more. The weight-only modes are made
for memory (int4 tinygemm is made for few rows, w8a16 on CUDA casts its weight to bf16
before cuBLAS: weight_only.py says why); their lines are measured, and the kernel line
says at which row counts each kernel beats bf16. On a CPU all of it runs small, for the
code path (no targets).
"""
from __future__ import annotations

import copy
import math
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import gpu_models
import gpu_speed
from gpu_report import BudgetExceeded, report
from pipeline.kernels import cuda_kernels
from pipeline.layers.quantization import weight_only as wq

QUANT_MODES = ("fp8", "w8a16", "w4a16")
FP8_THROUGHPUT_TARGET = 1.0   # fp8 at least as fast as bf16 on the same workload


def fp8_capable() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def runnable_modes(device: str) -> tuple[list[str], dict[str, str]]:
    """The modes this device runs, and why the others are skipped."""
    if device != "cuda":
        return list(QUANT_MODES), {}
    skipped = {}
    if not fp8_capable():
        skipped["fp8"] = f"compute capability {torch.cuda.get_device_capability()} < (8, 9): no FP8 tensor cores"
    if torch.cuda.get_device_capability() < (8, 0):
        skipped["w4a16"] = "tinygemm needs compute capability 8.0"
    return [m for m in QUANT_MODES if m not in skipped], skipped


# ---- each mode's layer against its reference ----------------------------------------------------

# The device's layer against reference() (the CUDA op's arithmetic in plain PyTorch, computed on
# the CPU from the same quantized tensors), worst row relative to it: bf16 roundings (the tests
# bound the CPU op at 2e-3, 1e-2, 1e-2), against 4-10% of quantization error.
REFERENCE_BOUND = {"fp8": 5e-3, "w8a16": 1.5e-2, "w4a16": 1.5e-2}


def check_reference(run) -> None:
    device = torch.device(run.device)
    modes, skipped = runnable_modes(run.device)
    shapes = [(37, 53, True), (2048, 3072, False), (8192, 2048, False)] if run.device == "cuda" \
        else [(37, 53, True), (256, 768, False)]
    torch.manual_seed(0)
    worst: dict[str, float] = {}
    by_shape: dict[str, dict[str, float]] = {}   # mode -> "KxN/rows" -> worst row error
    fp8_exact: dict[str, dict[str, float]] = {}  # fp8's device op and reference against float64
    raised: dict[str, str] = {}
    for mode in modes:
        try:   # one mode that raises must not hide the others' figures
            for k, n, bias in shapes:
                linear = nn.Linear(k, n, bias=bias)
                with torch.no_grad():
                    linear.weight.normal_(0, 0.02)
                layer = wq.quantized_linear(mode, linear, device, torch.bfloat16, keep_unpacked=True)
                on_cpu = copy.deepcopy(layer).cpu()
                for rows in (1, 16, 256):
                    x = torch.randn(rows, k, dtype=torch.bfloat16)
                    with torch.inference_mode():
                        got, want = layer(x.to(device)).cpu().float(), on_cpu.reference(x).float()
                    error = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
                    # max() drops a NaN (max(0.0, nan) is 0.0): a NaN kernel must fail, not pass
                    error = error if math.isfinite(error) else math.inf
                    worst[mode] = max(worst.get(mode, 0.0), error)
                    by_shape.setdefault(mode, {})[f"{k}x{n}/{rows}"] = float(f"{error:.3g}")
                    if mode == "fp8":   # which side is off: the product of the same fp8 tensors in float64
                        exact = fp8_float64(on_cpu, x)
                        sides = [("device", got), ("reference", want)]
                        if device.type == "cuda":   # and the other product (this instance only)
                            layer.triton_product = not layer.triton_product
                            other = "device_triton_product" if layer.triton_product else "device_scaled_mm"
                            with torch.inference_mode():
                                sides.append((other, layer(x.to(device)).cpu().float()))
                            del layer.triton_product
                        for side, value in sides:
                            e = ((value.double() - exact).norm(dim=-1) / exact.norm(dim=-1)).max().item()
                            fp8_exact.setdefault(side, {})[f"{k}x{n}/{rows}"] = float(f"{e:.3g}")
        except BudgetExceeded:
            raise
        except Exception as e:
            raised[mode] = f"{type(e).__name__}: {e}"
        gpu_speed.free_memory()
    ok = not raised and all(worst[m] <= REFERENCE_BOUND[m] for m in worst)
    report("quantized_kernels_equal_reference", "passed" if ok else "failed", device=run.device,
           shapes=[list(s) for s in shapes], rows=[1, 16, 256],
           worst_row_error={m: float(f"{e:.3g}") for m, e in worst.items()}, bounds=REFERENCE_BOUND, skipped=skipped,
           raised=raised, by_shape=by_shape, fp8_against_float64=fp8_exact)


def fp8_float64(layer: wq.Fp8Linear, x: torch.Tensor) -> torch.Tensor:
    """The fp8 layer's output from its quantized tensors, the products summed in float64."""
    x8, x_scale = wq.quantize_fp8_rows(layer.pad_input(x.reshape(-1, layer.in_features), layer.weight.shape[1]))
    y = (x8.double() @ layer.weight.double().t()) * x_scale.double() * layer.weight_scale.double()
    y = y[:, :layer.out_features]
    return y if layer.bias is None else y + layer.bias.double()


# ---- the kernels of one decoder layer ------------------------------------------------------------

def layer_shapes(shape: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of the four decoder linears of a model shape (fused q/k/v and gate/up)."""
    h, i, hd = shape["hidden_size"], shape["intermediate_size"], shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd
    return {"qkv_proj": (h, q + 2 * kv), "o_proj": (q, h), "gate_up_proj": (h, 2 * i), "down_proj": (i, h)}


def timed(fn, device: str, iters: int) -> float:
    """Median microseconds of fn() (CUDA events on a GPU)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def graphed_us(fn, device: str, launches: int = 20, replays: int = 5) -> float:
    """Median microseconds of fn() as a decode step runs it: `launches` calls captured in one
    CUDA graph, so no launch latency is counted (timed() counts it: a Triton launch's
    Python alone is tens of microseconds). Off CUDA, timed() once."""
    if device != "cuda":
        return timed(fn, device, 1)
    fn()   # compiles, warms
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / launches)
    return statistics.median(times)


def _raising(error: Exception):
    def call(_x):
        raise error
    return call


def kernel_candidates(linear: nn.Linear, device: str, dtype: torch.dtype, modes: list[str]) -> dict:
    """name -> f(x) for one linear: bf16 (cuBLAS), each mode's module as the engine runs it,
    and on CUDA the kernels weight_only does not use, for the record: fp8's _scaled_mm
    alone (without quantizing the activations; row-wise with Fp8Linear's accumulation and
    the other, and with one scale per tensor) and fp8_matmul_triton's product alone (all row
    counts here are within its MAX_ROWS), `_weight_int8pack_mm` (its CUDA kernel),
    and int8 x int8 `_int_mm` with per-token int8 activations (a w8a8 for CUDA)."""
    dev = torch.device(device)
    weight = linear.weight.detach().to(dev, dtype)
    out = {"bf16" if dtype == torch.bfloat16 else str(dtype).removeprefix("torch."): lambda x: F.linear(x, weight)}
    modules = {}
    for m in modes:
        try:
            modules[m] = out[m] = wq.quantized_linear(m, linear, dev, dtype)
        except BudgetExceeded:
            raise
        except Exception as e:   # timed as a kernel that raises: its error is reported, the rest run
            out[m] = _raising(RuntimeError(f"building the {m} layer: {type(e).__name__}: {e}"))
    if device != "cuda":
        return out
    if "fp8" in modules:
        fp8 = modules["fp8"]
        x_scale_of = {}

        def quantized(x):   # the activations quantized once per row count: the products alone are timed
            if x.shape[0] not in x_scale_of:
                x_scale_of[x.shape[0]] = wq.quantize_fp8_rows(x)
            return x_scale_of[x.shape[0]]

        def scaled_mm_only(fast: bool, tensorwise: bool = False):
            def call(x):
                x8, sx = quantized(x)
                sw = fp8.weight_scale
                if tensorwise:   # one scale each (the largest: no value overflows), cuBLASLt's own fp8 path
                    sx, sw = sx.max(), sw.max()
                return torch._scaled_mm(x8, fp8.weight.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16,
                                        use_fast_accum=fast)
            return call
        out["fp8_scaled_mm_only"] = scaled_mm_only(fp8.fast_accumulation)
        out[f"fp8_scaled_mm_only_fast_accumulation_{not fp8.fast_accumulation}"] = scaled_mm_only(
            not fp8.fast_accumulation)
        out["fp8_scaled_mm_tensorwise_fast_accumulation"] = scaled_mm_only(True, tensorwise=True)
        from pipeline.kernels import fp8_matmul_triton   # imported on CUDA only, as the engine does

        def triton_product_only(x):   # fp8_matmul_triton at its launch for these rows (LAUNCHES)
            x8, sx = quantized(x)
            return fp8_matmul_triton.fp8_matmul(x8, fp8.weight, sx, fp8.weight_scale, torch.bfloat16)
        out["fp8_triton_product_only"] = triton_product_only
    w8 = modules.get("w8a16") or wq.quantized_linear("w8a16", linear, dev, dtype)
    out["w8a16_weight_int8pack_mm"] = lambda x: torch._weight_int8pack_mm(x, w8.weight, w8.scale)
    q8, s8 = w8.weight, w8.scale.float()

    def int8_dynamic(x):
        xq, sx = wq.quantize_int8_rows(x)   # per token, symmetric
        return (torch._int_mm(xq, q8.t()).float() * sx[:, None] * s8).to(dtype)
    out["w8a8_int_mm_dynamic"] = int8_dynamic
    return out


def check_kernels(run) -> None:
    """One line: microseconds per decoder layer (its four linears) for each kernel and row
    count; on CUDA each captured in a graph (graphed_us), so launch latency is not counted."""
    device = run.device
    shape = gpu_models.LLAMA_1B if device == "cuda" else gpu_models.SMALL_SPEED
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows = (1, 16, 256) if device == "cuda" else (1, 64)
    iters = 20 if device == "cuda" else 3
    modes, skipped = runnable_modes(device)
    torch.manual_seed(0)
    us: dict[str, dict[int, float | None]] = {}
    errors: dict[str, str] = {}
    for name, (k, n) in layer_shapes(shape).items():
        linear = nn.Linear(k, n, bias=False)
        with torch.no_grad():
            linear.weight.normal_(0, 0.02)
        candidates = kernel_candidates(linear, device, dtype, modes)
        for m in rows:
            x = torch.randn(m, k, device=device, dtype=dtype)
            for kernel, fn in candidates.items():
                if kernel in errors:
                    continue
                if kernel == "w8a8_int_mm_dynamic" and m <= 16:   # _int_mm on CUDA: more than 16 rows
                    us.setdefault(kernel, {})[m] = None
                    continue
                try:
                    with torch.inference_mode():   # on CUDA in a graph, as decode steps run
                        t = graphed_us(lambda: fn(x), device) if device == "cuda" else timed(lambda: fn(x), device, iters)
                except RuntimeError as e:
                    errors[kernel] = f"{type(e).__name__}: {e}"[:200]
                    us.pop(kernel, None)
                    continue
                slot = us.setdefault(kernel, {})
                slot[m] = None if slot.get(m, 0) is None else slot.get(m, 0) + t
        del candidates
        gpu_speed.free_memory()
    base = next(iter(us))
    speedup = {kernel: {m: (round(us[base][m] / t, 3) if t else None) for m, t in times.items()}
               for kernel, times in us.items() if kernel != base}
    report("quantized_matmul_kernels", "measured", device=device, dtype=str(dtype).removeprefix("torch."),
           model="llama-3.2-1b-shape" if device == "cuda" else "small", rows=list(rows),
           us_per_layer={kernel: {m: (round(t, 1) if t else None) for m, t in times.items()} for kernel, times in us.items()},
           speedup_vs_unquantized=speedup, errors=errors, skipped=skipped)


# ---- the engine's throughput with each mode ------------------------------------------------------

def check_throughput(run) -> None:
    """Each mode on throughput_pipeline's model and workload, against its unquantized number
    (the same engine options, only the quantization differs). Needs throughput_pipeline to
    have run in this process (it keeps what it measured on run.speed)."""
    speed = getattr(run, "speed", None)
    modes, skipped = runnable_modes(run.device)
    for mode, reason in skipped.items():
        report(f"throughput_{mode}", "skipped", reason=reason)
    if speed is None:
        for mode in modes:
            report(f"throughput_{mode}", "skipped", reason="throughput_pipeline did not run: no unquantized number")
        return
    base = speed["ours"]
    per_mode_s = 75 if run.device == "cuda" else 30
    # On CUDA, fp8 twice more: with the other product at decode steps (the Triton kernel of
    # fp8_matmul_triton, or `_scaled_mm`: Fp8Linear.triton_product), and with its activations
    # quantized by PyTorch's ops instead of the Triton kernel (pointwise_triton.quantize_fp8_rows):
    # what each buys.
    runs = [(f"throughput_{m}", m) for m in modes]
    flipped = "throughput_fp8_scaled_mm" if wq.Fp8Linear.triton_product else "throughput_fp8_triton_product"
    if run.device == "cuda" and "fp8" in modes:
        at = modes.index("fp8") + 1
        runs[at:at] = [(flipped, "fp8"), ("throughput_fp8_pytorch_activation_quant", "fp8")]
    if run.device == "cuda":   # the unquantized number again, last: how far one run's figure moves
        runs.append(("throughput_unquantized_again", "none"))
    for name, mode in runs:
        left = run.left()
        if left < 45:   # an engine build and its graph capture come before the timed part
            report(name, "skipped", reason=f"wall-clock budget: {left:.0f} s left")
            continue
        deadline = time.monotonic() + min(per_mode_s, left - 10)
        fused, product = cuda_kernels.triton_fp8_rows, wq.Fp8Linear.triton_product
        if name.endswith("pytorch_activation_quant"):
            cuda_kernels.triton_fp8_rows = lambda x: None   # what weight_only.Fp8Linear asks
        if name == flipped:
            wq.Fp8Linear.triton_product = not product
        try:
            ours = gpu_speed.run_pipeline(speed["model_dir"], run.device, speed["prompts"], speed["output_len"],
                                          deadline, quantization=mode)
        except BudgetExceeded:
            raise
        except Exception as e:   # the next mode still runs
            report(name, "error", error=f"{type(e).__name__}: {e}")
            gpu_speed.free_memory()
            continue
        finally:
            cuda_kernels.triton_fp8_rows, wq.Fp8Linear.triton_product = fused, product
        ratio = ours["output_tok_s"] / base["output_tok_s"] if base["output_tok_s"] else float("nan")
        gpu = run.device == "cuda"
        comparable = not ours["truncated_by_budget"] and not base.get("truncated_by_budget")
        if gpu and name == "throughput_fp8" and comparable and not ours["errors"]:
            status = "passed" if ratio >= FP8_THROUGHPUT_TARGET else "failed"
        else:
            status = "measured"
        report(name, status, device=run.device, model=speed["model"], quantization=mode,
               sequences=len(speed["prompts"]), prompt_tokens=len(speed["prompts"][0]),
               output_tokens_each=speed["output_len"], **ours, unquantized_output_tok_s=base["output_tok_s"],
               unquantized_weight_bytes=base["weight_bytes"], ratio_vs_unquantized=round(ratio, 3),
               target=FP8_THROUGHPUT_TARGET if name == "throughput_fp8" else None)
