"""Linear layers quantized with what PyTorch itself ships, for CUDA first: fp8, w8a16, w4a16.

Each class replaces one nn.Linear of the decoder (quantization.QUANTIZED_LAYERS; the LM
head and the embeddings stay in the compute dtype). The quantization arithmetic is one
function per mode (`quantize_fp8_rows`, `quantize_int8_rows`, `quantize_int4_groups`), run
wherever the weight is, so a CPU and a GPU hold the same numbers; only the matrix product
differs by device, and `reference()` is what the CUDA op computes, written in plain
PyTorch (the tests compare the CPU op with it; benchmarks/gpu_check.py the CUDA op).

- fp8 (Fp8Linear): weights float8 e4m3 with a float32 scale per output channel,
  activations quantized per token (dynamic) at each call; `torch._scaled_mm` row-wise on
  FP8 tensor cores (Ada, Hopper: compute capability >= 8.9), twice bf16's rate on Hopper.
  A CPU runs the same through PyTorch's CPU `_scaled_mm` (slow: for tests).
- w8a16 (Int8WeightLinear): int8 weights, a scale per output channel, activations in the
  compute dtype. CPU: `torch._weight_int8pack_mm`. CUDA: the int8 weight cast to the
  compute dtype and cuBLAS, scale applied to the output, because `_weight_int8pack_mm`'s
  CUDA kernel (aten/src/ATen/native/cuda/int8mm.cu) is one thread per output element on
  CUDA cores, no tensor cores: far slower than bf16. So on CUDA w8a16 halves the weights'
  memory, not the time (benchmarks/gpu_check.py measures both kernels).
- w4a16 (Int4WeightLinear): int4 weights in groups of 32 along the input (see
  INT4_GROUP_SIZES), asymmetric: a bf16 scale and zero per group and output channel;
  CUDA: tinygemm, `torch._weight_int4pack_mm` (tensor cores, sm80+, bf16 activations, made
  for few rows); CPU: `torch._weight_int4pack_mm_for_cpu`. About 5/16 of bf16's weight
  bytes (4 bits a weight and 1 of scales and zeros).

Shapes the kernels cannot take are padded with zeros at load (weights) and per call
(activations' input dimension only); the padded output channels are sliced off. The
decoder's own shapes (multiples of 64) never pad.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.kernels import cuda_kernels

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0            # largest finite e4m3fn
FP8_MIN_AMAX = 1e-12       # a zero row gets this amax (its values stay 0), never a 0 scale
# tinygemm takes groups of 32, 64, 128 or 256; 32 costs a bit a weight more (a bf16 scale and
# zero per 32) but on the bundled model gave perplexity 11.42 against 17.6 (64) and 22.2 (128),
# float32 11.38 (its weights come from a Q4_1 GGUF, itself in groups of 32, which flatters 32).
INT4_GROUP_SIZES = (32,)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# ---- the quantization arithmetic, one function per mode, any device ------------------------

def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of x [rows, k] to e4m3 with a float32 scale per row [rows, 1] (scale =
    max|row| / 448): x ~ x8.float() * scale. Used for the weights (a row: an output
    channel) once at load and for the activations (a row: a token) at every call."""
    xf = x.float()
    # abs().amax(): the inf-norm's value; torch.linalg's inf-norm measured 16x slower on a CPU
    # Times the reciprocal, not divided: PyTorch's CUDA division by a number multiplies by
    # its reciprocal, so written so the CPU, CUDA and the Triton kernel give the same bits.
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp_(min=FP8_MIN_AMAX) * (1.0 / FP8_MAX)
    # The clamp only catches rounding at the edge: e4m3fn has no infinity (above 448: NaN).
    return (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row (output channel): w ~ q * scale, q in [-127, 127], scale [rows]
    float32 (a zero row gets the smallest normal scale: its q stay 0). w8a16's weights and
    w8a8's (int8_linear.py) alike."""
    wf = w.detach().float()
    scale = wf.abs().amax(dim=-1).clamp_(min=torch.finfo(torch.float32).tiny) / 127.0
    return (wf / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8), scale


def quantize_int4_groups(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """tinygemm's asymmetric int4: per output channel and group of `group_size` inputs, a
    scale s and a zero z (both rounded to bf16, as the kernels read them) with
    w ~ (q - 8) * s + z, q in [0, 15]. Returns q [n, k] int32 and scales_and_zeros
    [k / group_size, n, 2] bf16 (the layout both ops take). q is computed against the
    rounded s and z, so the dequantized value is the nearest one the kernel can make."""
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(dim=-1, keepdim=True), g.amax(dim=-1, keepdim=True)
    s = ((hi - lo) / 15).clamp_(min=1e-6).to(torch.bfloat16).float()
    z = (lo + 8 * s).to(torch.bfloat16).float()
    q = ((g - z) / s + 8).round_().clamp_(0, 15).to(torch.int32).reshape(n, k)
    scales_and_zeros = torch.cat([s, z], dim=-1).to(torch.bfloat16).transpose(0, 1).contiguous()
    return q, scales_and_zeros


def dequantize_int4(q: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """What tinygemm's CUDA kernel multiplies by: bf16((q - 8) * s + z) (one __hfma2 in bf16),
    [n, k] bf16. The CPU kernel does the same multiply-add in float32 without the rounding."""
    s = scales_and_zeros[..., 0].float().t().repeat_interleave(group_size, dim=1)   # [n, k]
    z = scales_and_zeros[..., 1].float().t().repeat_interleave(group_size, dim=1)
    return ((q.float() - 8) * s + z).to(torch.bfloat16)


def pack_int4_for_cuda(q: torch.Tensor) -> torch.Tensor:
    """q [n, k] in [0, 15] to the uint8 [n, k / 2] `_convert_weight_to_int4pack` takes (torch
    >= 2.5): two values a byte, the even k in the high nibble (int4mm.cu's packing comment)."""
    return (q[:, ::2] * 16 + q[:, 1::2]).to(torch.uint8)


def unpack_int4_cuda_layout(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_int4_for_cuda, as int4mm.cu reads the bytes (for tests)."""
    p = packed.to(torch.int32)
    return torch.stack([p >> 4, p & 0xF], dim=-1).reshape(packed.shape[0], -1)


# ---- the modules --------------------------------------------------------------------------

class QuantizedLinear(nn.Module):
    """What the three share: y = x W^T (+ bias) over the last dimension, the bias in the
    compute dtype, padded output channels sliced off. Quantized tensors are Parameters
    (requires_grad=False) so that they move with the module and count as its weights;
    do not .to(dtype) such a module (float8 weights are floating point)."""
    mode = ""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, device: torch.device, compute_dtype: torch.dtype) -> "QuantizedLinear":
        """Quantize `linear` (any device, any float dtype) into a module on `device`: the
        float weight is moved there first, so a GPU does the arithmetic."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self.matmul(x.reshape(-1, self.in_features))
        if y.shape[-1] != self.out_features:   # padded output channels
            y = y[:, :self.out_features].contiguous()
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """forward() as the CUDA op computes it, in plain PyTorch on the CPU."""
        raise NotImplementedError

    def pad_input(self, x: torch.Tensor, k: int) -> torch.Tensor:
        return x if x.shape[-1] == k else F.pad(x, (0, k - x.shape[-1]))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _float_weight(linear: nn.Linear, device, rows: int, cols: int) -> torch.Tensor:
    """The linear's weight on `device` in float32, zero-padded to [rows, cols]."""
    w = linear.weight.detach().to(device, torch.float32)
    return F.pad(w, (0, cols - w.shape[1], 0, rows - w.shape[0]))


def _bias(linear: nn.Linear, device, dtype) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.detach().to(device, dtype)


class Fp8Linear(QuantizedLinear):
    """FP8 e4m3 weights (a scale per output channel) x FP8 e4m3 activations (a scale per
    token, computed each call): `torch._scaled_mm` with row-wise scales, float32
    accumulation (below), out in the compute dtype.

    CUDA's layout rules (ScaledBlas.cpp): the first operand row-major, the second
    column-major (the [N, K] weight passed as weight.t()), K and N multiples of 16,
    scale_a [M, 1] and scale_b [1, N] float32 contiguous, and for row-wise scaling a
    bf16/fp16/fp32 out (bf16 only on older versions' CUTLASS path): K and N are padded
    to 16 at load, the activations' K per call, and the product comes out in bf16 on
    CUDA (cast to a float32 compute dtype if that is what the engine runs)."""
    mode = "fp8"
    # Hopper's FP8 tensor cores sum products in a narrower accumulator, which cuBLAS promotes
    # to float32 every few K steps unless told to accumulate "fast" (no promotion), as
    # TransformerEngine's and torchao's inference forwards do. Measured on an H200
    # (benchmarks/gpu_check.py times and checks both): fast was 4% quicker for a 1B layer's
    # products alone at 256 rows and 3-5% slower at 1 and 16, equal end to end (1.407
    # against 1.408 s), and 0.28% from the float64 product at K = 8,192 against 0.18%: off.
    # A CPU's _scaled_mm ignores it.
    fast_accumulation = False
    # The Triton product for decode steps' rows (kernels/fp8_matmul_triton.py): off until a GPU
    # measures it faster than _scaled_mm (benchmarks/fp8_matmul_sweep.py; it has not run on one).
    triton_product = False

    def __init__(self, in_features, out_features, weight, weight_scale, bias=None):
        super().__init__(in_features, out_features, bias)
        self.weight = nn.Parameter(weight, requires_grad=False)              # [Np, Kp] e4m3, row-major
        self.weight_scale = nn.Parameter(weight_scale, requires_grad=False)  # [1, Np] float32

    @classmethod
    def from_linear(cls, linear, device, compute_dtype):
        n, k = linear.out_features, linear.in_features
        weight, scale = quantize_fp8_rows(_float_weight(linear, device, round_up(n, 16), round_up(k, 16)))
        return cls(k, n, weight, scale.reshape(1, -1).contiguous(), _bias(linear, device, compute_dtype))

    def _out_dtype(self, x: torch.Tensor) -> torch.dtype:
        if x.is_cuda and x.dtype not in (torch.bfloat16, torch.float16):
            return torch.bfloat16
        return x.dtype

    def matmul(self, x):
        fused = cuda_kernels.triton_fp8_rows(x)
        if fused is not None:   # CUDA: one kernel for the eight ops below
            x8, x_scale = fused.quantize_fp8_rows(x, self.weight.shape[1], FP8_MAX, FP8_MIN_AMAX)
        else:
            x8, x_scale = quantize_fp8_rows(self.pad_input(x, self.weight.shape[1]))
        product = cuda_kernels.triton_fp8_matmul(x8) if self.triton_product else None
        if product is not None:   # CUDA, a decode step's rows: tiles sized to them
            y = product.fp8_matmul(x8, self.weight, x_scale, self.weight_scale, self._out_dtype(x))
        else:
            y = torch._scaled_mm(x8, self.weight.t(), scale_a=x_scale, scale_b=self.weight_scale,
                                 out_dtype=self._out_dtype(x), use_fast_accum=self.fast_accumulation)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def reference(self, x):
        x2 = x.reshape(-1, self.in_features)
        x8, x_scale = quantize_fp8_rows(self.pad_input(x2, self.weight.shape[1]))
        acc = x8.float() @ self.weight.float().t()
        y = (acc * x_scale * self.weight_scale).to(x.dtype)[:, :self.out_features]
        return (y if self.bias is None else y + self.bias).view(*x.shape[:-1], self.out_features)


class Int8WeightLinear(QuantizedLinear):
    """int8 weights with a scale per output channel, activations in the compute dtype:
    y = (x q^T) * scale. CPU: `torch._weight_int8pack_mm` (fused). CUDA: q cast to the
    compute dtype, cuBLAS, then the scale (see the module docstring for why not the op).
    K is padded to a multiple of 16: the CPU op in bf16 reads past a row otherwise
    (torch 2.13 here: NaN, inf or a crash for K = 37 or 40)."""
    mode = "w8a16"

    def __init__(self, in_features, out_features, weight, scale, bias=None):
        super().__init__(in_features, out_features, bias)
        self.weight = nn.Parameter(weight, requires_grad=False)   # [N, Kp] int8
        self.scale = nn.Parameter(scale, requires_grad=False)     # [N] compute dtype

    @classmethod
    def from_linear(cls, linear, device, compute_dtype):
        n, k = linear.out_features, linear.in_features
        q, scale = quantize_int8_rows(_float_weight(linear, device, n, round_up(k, 16)))
        return cls(k, n, q, scale.to(compute_dtype), _bias(linear, device, compute_dtype))

    def matmul(self, x):
        scale = self.scale if self.scale.dtype == x.dtype else self.scale.to(x.dtype)
        x = self.pad_input(x, self.weight.shape[1])
        if x.is_cuda:
            return F.linear(x, self.weight.to(x.dtype)).mul_(scale)
        return torch._weight_int8pack_mm(x.contiguous(), self.weight, scale)

    def reference(self, x):
        x2 = self.pad_input(x.reshape(-1, self.in_features), self.weight.shape[1])
        # cuBLAS: float32 accumulation rounded to the compute dtype, then the scale.
        y = (x2.float() @ self.weight.float().t()).to(x.dtype) * self.scale.to(x.dtype)
        return (y if self.bias is None else y + self.bias).view(*x.shape[:-1], self.out_features)


def int4_layout(in_features: int, out_features: int) -> tuple[int, int, int, int]:
    """(group size, inner k tiles, padded K, padded N) for tinygemm and its CPU twin.
    CUDA: K a multiple of the group and of 16 * inner_k_tiles, N of 8; the CPU op wants N
    a multiple of 16. The first of INT4_GROUP_SIZES that divides K, else the last (K padded
    to it); inner_k_tiles the largest of 8, 4, 2 that divides K / 16."""
    group = next((g for g in INT4_GROUP_SIZES if in_features % g == 0), None)
    k = in_features if group else round_up(in_features, INT4_GROUP_SIZES[-1])
    group = group or INT4_GROUP_SIZES[-1]
    tiles = next(t for t in (8, 4, 2) if k % (16 * t) == 0)
    return group, tiles, k, round_up(out_features, 16)


class Int4WeightLinear(QuantizedLinear):
    """int4 weights, asymmetric per group (tinygemm's format), activations in the compute
    dtype. CUDA: `torch._weight_int4pack_mm` on the weight packed by
    `_convert_weight_to_int4pack` ([N/8, K/(16 tiles), 32, tiles/2] int32), bf16 activations
    (others are cast). CPU: `_weight_int4pack_mm_for_cpu` on `_convert_weight_to_int4pack_for_cpu`'s
    [N, K/2] uint8. Both dequantize (q - 8) * scale + zero inside the kernel."""
    mode = "w4a16"

    def __init__(self, in_features, out_features, packed, scales_and_zeros, group_size, bias=None, q=None):
        super().__init__(in_features, out_features, bias)
        self.group_size = group_size
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.scales_and_zeros = nn.Parameter(scales_and_zeros, requires_grad=False)   # [Kp/g, Np, 2] bf16
        # The unpacked int4 values [Np, Kp], kept only when asked (reference(): tests, gpu_check).
        self.register_buffer("q", q, persistent=False)

    @classmethod
    def from_linear(cls, linear, device, compute_dtype, keep_unpacked: bool = False):
        n, k = linear.out_features, linear.in_features
        group, tiles, kp, np_ = int4_layout(k, n)
        q, scales_and_zeros = quantize_int4_groups(_float_weight(linear, device, np_, kp), group)
        packed = cls.pack(q, tiles)
        return cls(k, n, packed, scales_and_zeros, group, _bias(linear, device, compute_dtype),
                   q=q if keep_unpacked else None)

    @staticmethod
    def pack(q: torch.Tensor, inner_k_tiles: int) -> torch.Tensor:
        if q.is_cuda:
            return torch.ops.aten._convert_weight_to_int4pack(pack_int4_for_cuda(q), inner_k_tiles)
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, inner_k_tiles)

    def matmul(self, x):
        k = self.scales_and_zeros.shape[0] * self.group_size
        if x.is_cuda:
            x16 = self.pad_input(x.to(torch.bfloat16), k).contiguous()
            y = torch.ops.aten._weight_int4pack_mm(x16, self.weight, self.group_size, self.scales_and_zeros)
            return y if y.dtype == x.dtype else y.to(x.dtype)
        sz = self.scales_and_zeros if x.dtype == torch.bfloat16 else self.scales_and_zeros.to(x.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(self.pad_input(x, k).contiguous(), self.weight,
                                                          self.group_size, sz)

    def reference(self, x):
        if self.q is None:
            raise ValueError("reference() needs the unpacked values: from_linear(..., keep_unpacked=True)")
        x2 = self.pad_input(x.reshape(-1, self.in_features), self.q.shape[1])
        w = dequantize_int4(self.q, self.scales_and_zeros, self.group_size)
        y = (x2.to(torch.bfloat16).float() @ w.float().t()).to(x.dtype)[:, :self.out_features]
        return (y if self.bias is None else y + self.bias).view(*x.shape[:-1], self.out_features)


MODES = {cls.mode: cls for cls in (Fp8Linear, Int8WeightLinear, Int4WeightLinear)}


def check_device(mode: str, device: torch.device) -> None:
    """Refuse, before anything loads, a GPU that cannot run `mode`."""
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    name = torch.cuda.get_device_name(device)
    if mode == "fp8" and (major, minor) < (8, 9):
        raise ValueError(f"quantization 'fp8' needs FP8 tensor cores (compute capability 8.9 or later: Ada, "
                         f"Hopper, Blackwell); {name} is {major}.{minor}. Use 'w8a16' or 'w4a16' (or int8/nf4)")
    if mode == "w4a16" and major < 8:
        raise ValueError(f"quantization 'w4a16' needs compute capability 8.0 or later (bf16 tensor cores); "
                         f"{name} is {major}.{minor}. Use 'w8a16' (or int8/nf4)")
    if mode == "fp8":
        _probe_fp8(device)


@functools.cache
def _probe_fp8(device: torch.device) -> None:
    """One 16x16x16 row-wise _scaled_mm: a torch or CUDA build without it fails here, at
    start-up, with its own message, rather than in the first step."""
    try:
        a = torch.zeros(16, 16, device=device).to(FP8)
        scale = torch.ones(16, 1, device=device)
        torch._scaled_mm(a, a.t(), scale_a=scale, scale_b=scale.t().contiguous(), out_dtype=torch.bfloat16)
    except RuntimeError as e:
        raise ValueError(f"quantization 'fp8': this torch cannot run row-wise torch._scaled_mm on this GPU: {e}") from e


def quantized_linear(mode: str, linear: nn.Linear, device: torch.device, compute_dtype: torch.dtype,
                     keep_unpacked: bool = False) -> nn.Module:
    """`linear` (any device) as mode's module on `device`, in eval mode. keep_unpacked: w4a16
    also keeps its unpacked values, for reference() (the other modes' tensors are unpacked)."""
    kwargs = dict(keep_unpacked=True) if keep_unpacked and mode == "w4a16" else {}
    with torch.no_grad():
        return MODES[mode].from_linear(linear, device, compute_dtype, **kwargs).eval()
