"""CPU int8 linear layers (`--quantization w8a8`): int8 weights, int8 activations, fbgemm's
or (on CPUs with AMX) oneDNN's GEMM.

Weights are quantized once, at load, symmetrically per output channel (scale = the row's
largest |w| / 127) and packed into fbgemm's layout. Activations are quantized per token
at run time: each row is divided by its largest |x| (so it lies in [-1, 1]) and then
quantized with fixed parameters, and the output row is multiplied back. Fixed parameters
make a row's result independent of the other rows in the batch, bit for bit (the int32
accumulation is exact), so prefix caching, preemption and speculative verification see
the same numbers whatever a step holds. fbgemm's own dynamic path picks one range for the
whole batch: a token with large activations coarsens every other (perplexity 28.8 against
11.4 on the bundled model, measured).

fbgemm multiplies unsigned 8-bit activations by signed 8-bit weights with vpmaddubsw,
which saturates its int16 pair sums on CPUs without AVX-512 VNNI; there activations keep
129 levels (0..128, |sum| <= 2 * 128 * 127 < 2**15), what PyTorch's reduce_range does for
the same reason. With AVX-512 VNNI they take 255 levels, if a self-check against the
PyTorch path agrees (it did on an AMD EPYC with AVX-512 VNNI).
Before the swap the engine smooths the model (smoothing.py): outlier channels moved into
the weights, so one scale per token loses less.

On a CPU with AMX (amx_int8: Intel Xeon since Sapphire Rapids) the product runs on
oneDNN instead (`onednn.qlinear_pointwise`, the op PyTorch's own x86 int8 inference uses),
whose AMX kernels fbgemm lacks: measured there on the bundled model's shapes at 64 and
1,024 rows, its int8 product alone took 0.3-0.8 of the time of oneDNN's bf16 one, and
w8a8 ran 1.24-1.49x faster end to end than on fbgemm. oneDNN gives the exact int32 sums
(unit scales); a C kernel (kernels/quantize_rows.c) quantizes each row before (one call,
where PyTorch's six ops took longer than the product) and applies the token's and the
channel's scales after, in one order for every shape, since oneDNN's own dequantization
rounded a row differently alone and in a batch. 255 levels: VNNI and AMX multiply-add
into int32 without saturating.

The PyTorch path ("reference") computes the same arithmetic in float32 from dequantized
weights: it serves where neither library is usable or passes its self-check, and
PIPELINE_INT8_GEMM=reference forces it (=fbgemm forces fbgemm over oneDNN). The choice is
made once per process and logged.
"""
from __future__ import annotations

import functools
import logging
import os
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.kernels import cpu_kernels
from pipeline.layers.quantization.weight_only import quantize_int8_rows

log = logging.getLogger(__name__)

FORCE_ENV = "PIPELINE_INT8_GEMM"   # "reference": the PyTorch path whatever the CPU offers; "fbgemm": not oneDNN
# (scale, zero point) of the per-token quantization of rows already in [-1, 1]: 7 bits
# where vpmaddubsw could saturate, 8 with VNNI. Powers of two keep x / scale exact.
NARROW_ACTIVATIONS = (1 / 64, 64)      # 0..128
FULL_ACTIVATIONS = (1 / 127, 128)      # 1..255
MIN_TOP = 1e-30   # the oneDNN path's floor of a row's max |x| (kernels/quantize_rows.c): 127 / it is finite


@dataclass(frozen=True)
class Int8Gemm:
    """How int8 linear layers multiply in this process."""
    kernel: str                  # "onednn", "fbgemm" or "reference"
    activation_qparams: tuple    # (scale, zero point) for rows in [-1, 1]
    reason: str


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            line = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


def _fbgemm_op():
    """fbgemm's linear taking float input with given quantization parameters and giving
    float output, or None where this PyTorch lacks it."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return None
    return getattr(torch.ops.quantized, "linear_with_input_q_dq_qweight_dq_output_fp32", None)


def _onednn_ops() -> bool:
    """Whether this PyTorch has oneDNN's int8 linear (prepack and pointwise)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_prepack")
            and hasattr(torch.ops.onednn, "qlinear_pointwise"))


def _agrees_with_reference(qparams: tuple, kernel: str = "fbgemm") -> bool:
    """A library's kernel against the PyTorch path on random rows and on the worst case for
    saturation (every activation at the top of its range, every weight +127)."""
    generator = torch.Generator().manual_seed(0)
    linear = nn.Linear(64, 24, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(24, 64, generator=generator))
        linear.weight[0] = 1.0
        x = torch.cat([torch.randn(5, 64, generator=generator), torch.ones(1, 64)])
        try:
            got = Int8Linear(linear, Int8Gemm(kernel, qparams, "self-check"))(x)
        except RuntimeError as e:
            log.info("%s int8 linear failed its self-check: %s", kernel, e)
            return False
        expected = Int8Linear(linear, Int8Gemm("reference", qparams, "self-check"))(x)
    return torch.allclose(got, expected, rtol=1e-3, atol=1e-3)


@functools.cache   # once per process: every layer multiplies the same way
def int8_gemm() -> Int8Gemm:
    flags = cpu_flags()
    vnni = "avx512_vnni" in flags
    described = "AVX-512 VNNI" if vnni else "AVX2" if "avx2" in flags else "no AVX2"
    forced = os.environ.get(FORCE_ENV)
    choice = None
    if forced == "reference":
        choice = Int8Gemm("reference", NARROW_ACTIVATIONS, f"{FORCE_ENV}=reference")
    elif forced != "fbgemm" and "amx_int8" in flags and _onednn_ops() and _agrees_with_reference(
            FULL_ACTIVATIONS, "onednn"):
        choice = Int8Gemm("onednn", FULL_ACTIVATIONS, "CPU with AMX: 255 activation levels")
    elif _fbgemm_op() is None:
        choice = Int8Gemm("reference", NARROW_ACTIVATIONS, "this PyTorch has no fbgemm")
    else:
        candidates = [FULL_ACTIVATIONS, NARROW_ACTIVATIONS] if vnni else [NARROW_ACTIVATIONS]
        usable = next((q for q in candidates if _agrees_with_reference(q)), None)
        if usable is not None:
            levels = 255 if usable == FULL_ACTIVATIONS else 129
            choice = Int8Gemm("fbgemm", usable, f"CPU with {described}: {levels} activation levels")
        else:
            choice = Int8Gemm("reference", NARROW_ACTIVATIONS, "fbgemm failed its self-check")
    log.info("int8 linear layers: %s (%s)", choice.kernel, choice.reason)
    return choice


class Int8Linear(nn.Module):
    """y = x @ W^T + b, W int8 per output channel and x int8 per token (CPU; float32 or
    bfloat16 in and out, float32 inside)."""

    def __init__(self, linear: nn.Linear, gemm: Int8Gemm | None = None):
        super().__init__()
        self.gemm = gemm or int8_gemm()
        self.out_features, self.in_features = linear.weight.shape
        weight, scale = quantize_int8_rows(linear.weight)
        self.weight_bytes = weight.numel() + 4 * scale.numel()
        if self.gemm.kernel == "onednn":
            # oneDNN returns the exact int32 sums (unit scales); the scales are applied by us, in
            # one order for every shape: its own dequantization rounds differently by kernel,
            # so a row alone and in a batch of 300 came out different.
            self.packed = torch.ops.onednn.qlinear_prepack(weight, None)
            self.register_buffer("weight_scale", scale.float(), persistent=False)
            self.register_buffer("unit_scales", torch.ones(len(scale)), persistent=False)
            self.register_buffer("weight_zero_point", torch.zeros(len(scale), dtype=torch.long), persistent=False)
        elif self.gemm.kernel == "fbgemm":
            self.packed = _fbgemm_pack(weight, scale)
        else:   # the same products in float32: every int8 value and sum is exact there
            self.register_buffer("dequantized", weight.float() * scale[:, None], persistent=False)
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemm.kernel == "onednn":
            return self._onednn_forward(x)
        rows = x.reshape(-1, self.in_features).float()
        # Each token scaled into [-1, 1] by its own largest |x| (a zero row stays zero).
        # abs().amax(): the same value as an inf-norm, which measured 16x slower on a CPU.
        top = rows.abs().amax(dim=1, keepdim=True)
        top.clamp_(min=torch.finfo(torch.float32).tiny)
        unit = rows / top
        scale, zero_point = self.gemm.activation_qparams
        if self.gemm.kernel == "fbgemm":
            out = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
                unit, scale, zero_point, self.packed)
        else:
            quantized = torch.round(unit / scale).clamp_(-zero_point, 255 - zero_point)
            out = F.linear(quantized.mul_(scale), self.dequantized)
        out.mul_(top)
        if self.bias is not None:
            out.add_(self.bias)
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)


    def _onednn_forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        scale, zero_point = self.gemm.activation_qparams
        levels = round(1 / scale)
        fused = cpu_kernels.serves(rows)
        if fused:
            quantized, top = cpu_kernels.quantize_rows_u8(rows, levels, zero_point)
        else:   # the kernel's arithmetic in PyTorch (a true division for levels / top, as in C)
            rows = rows.float()
            top = rows.abs().amax(dim=1, keepdim=True).clamp_(min=MIN_TOP)
            factor = torch.full_like(top, levels).div_(top)
            quantized = torch.round(rows * factor).add_(zero_point).clamp_(0, 255).to(torch.uint8)
        sums = torch.ops.onednn.qlinear_pointwise(   # the int32 sums, as float32
            quantized, 1.0, zero_point, self.packed, self.unit_scales, self.weight_zero_point,
            None, 1.0, 0, torch.float32, "none", [], "")
        row_scale = top.mul_(scale)
        if fused:   # times both scales, plus the bias, into x's dtype: one pass
            out = cpu_kernels.scale_rows(sums, row_scale, self.weight_scale, self.bias, x.dtype)
        else:
            out = sums.mul_(row_scale).mul_(self.weight_scale)
            if self.bias is not None:
                out.add_(self.bias)
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)


def _fbgemm_pack(weight: torch.Tensor, scale: torch.Tensor):
    """fbgemm's packed form of an int8 weight with its per-channel scales (made once)."""
    with warnings.catch_warnings():   # quantized tensors are deprecated, yet fbgemm's only door
        warnings.simplefilter("ignore")
        qweight = torch._make_per_channel_quantized_tensor(
            weight, scale.double(), torch.zeros(len(scale), dtype=torch.long), 0)
        engine = torch.backends.quantized.engine
        try:   # the packed object carries its kernel; the global setting is restored
            torch.backends.quantized.engine = "fbgemm"
            return torch.ops.quantized.linear_prepack(qweight, None)
        finally:
            torch.backends.quantized.engine = engine


def quantize_linear_layers(model: nn.Module, names: tuple[str, ...]) -> int:
    """Swap the model's nn.Linear children called one of `names` for Int8Linear; how many."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if name in names and type(child) is nn.Linear:
                setattr(parent, name, Int8Linear(child))
                swapped += 1
    return swapped
