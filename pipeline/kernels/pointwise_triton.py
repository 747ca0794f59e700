"""A decoder layer's small elementwise steps fused, in Triton, for CUDA: what the C kernels
(this package) do for the CPU.

Eagerly, and inside a CUDA graph too, each PyTorch elementwise op is its own kernel over
the step's [tokens, hidden] activations: at a decode step's few hundred rows those
kernels are too small to be anything but launch latency, about a dozen of them a layer.
These cut them to three:
- add_rms_norm: residual += x, then RMSNorm of it, in one pass (two ops and a norm);
- silu_and_mul: silu(gate) * up of the fused gate/up projection (two ops and a copy);
- rotary_write_kv: q and k of the fused qkv projection rotated in place, and k and v
  stored in the paged cache at their slots (a cast, a complex product, a cast back and two
  index copies). The layout is the varlen backends' [blocks, block_size, kv_heads,
  head_dim]; rotary pairs are adjacent (RotaryEmbedding interleaves the checkpoint's rows).
Each computes in float32 and rounds once per output, as the C kernels do.
- quantize_fp8_rows: fp8 linears' activations, a scale per row (layers/quantization/weight_only.py), in one
  pass instead of eight PyTorch ops. It has a probe of its own (`fp8_usable`: bit-equal
  to the PyTorch formula), as only Ada and Hopper convert to float8.

`serves(t)` says whether they run for a tensor: a CUDA tensor in float16, bfloat16 or
float32, where Triton imports and a probe (each kernel once against its PyTorch formula,
on first use per device and dtype) passed; otherwise, said once in the log, the PyTorch
ops run. On a CPU they run only under Triton's interpreter (the tests).
"""
from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

log = logging.getLogger(__name__)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, dim, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < dim
    x = tl.load(x_ptr + row * dim + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        total = x + tl.load(residual_ptr + row * dim + cols, mask=ok, other=0.0).to(tl.float32)
        total = total.to(residual_ptr.dtype.element_ty)   # the residual stream keeps its dtype
        tl.store(residual_ptr + row * dim + cols, total, mask=ok)
        x = total.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, 0) / dim + eps)
    weight = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * dim + cols, (x * inv_rms * weight).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(gate_up_ptr + row * 2 * inter + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * inter + inter + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, (gate / (1.0 + tl.exp(-gate)) * up).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rotary_write_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, stride_qkv,
                            NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                            HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    # Whole rows, loaded contiguously; each row's adjacent pairs split apart in registers.
    head = tl.arange(0, HEADS_PAD)[:, None]          # q heads, then k heads
    col = tl.arange(0, 2 * HALF_PAD)[None, :]
    ok = (head < NUM_HEADS + NUM_KV_HEADS) & (col < 2 * HALF)
    row_ptr = qkv_ptr + token * stride_qkv + head * (2 * HALF) + col
    x = tl.load(row_ptr, mask=ok, other=0.0).to(tl.float32)
    even, odd = tl.split(tl.reshape(x, [HEADS_PAD, HALF_PAD, 2]))
    pair = tl.arange(0, HALF_PAD)[None, :]
    cos = tl.load(cos_ptr + token * HALF + pair, mask=pair < HALF, other=0.0)
    sin = tl.load(sin_ptr + token * HALF + pair, mask=pair < HALF, other=0.0)
    rotated = tl.reshape(tl.join(even * cos - odd * sin, even * sin + odd * cos), [HEADS_PAD, 2 * HALF_PAD])
    tl.store(row_ptr, rotated.to(qkv_ptr.dtype.element_ty), mask=ok)
    # k (rotated) and v into the cache: slot * kv_heads * head_dim is the token's row there.
    slot = tl.load(slot_ptr + token)
    kv_head = head - NUM_HEADS
    cache_row = slot * (NUM_KV_HEADS * 2 * HALF) + kv_head * (2 * HALF) + col
    tl.store(k_cache_ptr + cache_row, rotated.to(k_cache_ptr.dtype.element_ty), mask=ok & (kv_head >= 0))
    v_head = tl.arange(0, HEADS_PAD)[:, None]
    v_ok = (v_head < NUM_KV_HEADS) & (col < 2 * HALF)
    v = tl.load(qkv_ptr + token * stride_qkv + (NUM_HEADS + NUM_KV_HEADS + v_head) * (2 * HALF) + col, mask=v_ok,
                other=0.0)
    tl.store(v_cache_ptr + slot * (NUM_KV_HEADS * 2 * HALF) + v_head * (2 * HALF) + col, v, mask=v_ok)


@triton.jit
def _quantize_fp8_rows_kernel(x_ptr, out_ptr, scale_ptr, cols, stride_x, out_cols, min_amax, fp8_max,
                              inv_fp8_max, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + c, mask=c < cols, other=0.0).to(tl.float32)   # zeros past cols: padding
    # The same bits as PyTorch's: times the reciprocal for the scale (weight_only.py says why), then
    # a correctly rounded division (a plain `/` is approximate in Triton).
    scale = tl.maximum(tl.max(tl.abs(x), 0), min_amax) * inv_fp8_max
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -fp8_max), fp8_max)
    tl.store(out_ptr + row * out_cols + c, q.to(out_ptr.dtype.element_ty), mask=c < out_cols)
    tl.store(scale_ptr + row, scale)


# Each kernel's compile-time constants for a shape: the launches below take them, and so
# does tests/triton_compile_check.py, which compiles what they launch.

def norm_launch(dim: int) -> tuple[int, int]:
    """add_rms_norm's BLOCK (a whole row: one program a row) and its warps."""
    block = triton.next_power_of_2(dim)
    return block, max(1, min(16, block // 256))


def silu_block(inter: int) -> int:
    return min(1024, triton.next_power_of_2(inter))


def rotary_shape(num_heads: int, num_kv_heads: int, head_dim: int) -> dict:
    half = head_dim // 2
    return dict(NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=half,
                HEADS_PAD=triton.next_power_of_2(num_heads + num_kv_heads), HALF_PAD=triton.next_power_of_2(half))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rmsnorm(x) * weight; with a residual, residual += x first (in place) and that is
    normed. x and residual contiguous [rows, dim]."""
    dim = x.shape[-1]
    out = torch.empty_like(x)
    block, warps = norm_launch(dim)
    _add_rms_norm_kernel[(x.numel() // dim,)](x, x if residual is None else residual, weight, out, dim, eps,
                                              HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=warps)
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [tokens, 2 * inter] contiguous (gate first) -> silu(gate) * up [tokens, inter]."""
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = silu_block(inter)
    _silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block)
    return out


def rotary_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int) -> None:
    """Rotate q and k of qkv [tokens, (heads + 2 kv_heads) * head_dim] (rows may be a
    stride apart, each row contiguous) in place by cos/sin [tokens, head_dim/2] float32, and
    store k and v at slot_mapping [tokens] (int64, block * block_size + offset) of the
    contiguous caches [blocks, block_size, kv_heads, head_dim]."""
    head_dim = k_cache.shape[-1]
    if qkv.stride(-1) != 1 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("rotary_write_kv needs contiguous qkv rows and caches")
    if head_dim % 2 or qkv.shape[-1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"rotary_write_kv: qkv of {qkv.shape[-1]} columns is not {num_heads} + 2 x {num_kv_heads} "
                         f"heads of an even head_dim {head_dim}")
    _rotary_write_kv_kernel[(qkv.shape[0],)](
        qkv, cos.contiguous(), sin.contiguous(), slot_mapping, k_cache, v_cache, qkv.stride(0),
        **rotary_shape(num_heads, num_kv_heads, head_dim))


def quantize_fp8_rows(x: torch.Tensor, out_cols: int, max_value: float, min_amax: float,
                      out_dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] (rows may be a stride apart) -> (q [rows, out_cols] out_dtype, scale
    [rows, 1] float32) with scale = max(max|row|, min_amax) * (1 / max_value) and q = x / scale
    clamped to +-max_value, zero past cols. out_dtype float32 keeps q before the cast (how
    the tests check the arithmetic: Triton's interpreter casts to float8 wrongly)."""
    rows, cols = x.shape
    if x.stride(-1) != 1 or out_cols < cols:
        raise ValueError("quantize_fp8_rows needs contiguous rows and out_cols >= their length")
    out = torch.empty((rows, out_cols), dtype=out_dtype, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    block, warps = norm_launch(out_cols)
    _quantize_fp8_rows_kernel[(rows,)](x, out, scale, cols, x.stride(0), out_cols, min_amax, max_value,
                                       1.0 / max_value, BLOCK=block, num_warps=warps)
    return out, scale


@functools.cache
def fp8_usable(device: torch.device) -> bool:
    """quantize_fp8_rows once against the PyTorch formula on this device: the same bits
    (a zero row and padding included), else said once in the log and False."""
    gen = torch.Generator().manual_seed(0)
    problem = None
    try:
        x = (torch.randn(4, 40, generator=gen) * 3).to(device, torch.bfloat16)
        x[1] = 0
        got, got_scale = quantize_fp8_rows(x, 48, 448.0, 1e-12)
        xf = torch.nn.functional.pad(x, (0, 8)).float()
        scale = xf.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-12) * (1.0 / 448.0)
        want = (xf / scale).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)
        if not (torch.equal(got_scale, scale) and torch.equal(got.view(torch.uint8), want.view(torch.uint8))):
            problem = "quantize_fp8_rows differs from PyTorch's"
    except Exception as e:   # no float8 conversion on this GPU, a compile error, ...
        problem = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if problem is not None:
        log.warning("fp8 activation quantization (Triton) off on %s, the PyTorch ops run instead: %s", device, problem)
    return problem is None


def serves(*tensors: torch.Tensor) -> bool:
    """Whether the fused kernels run for these tensors: all on one CUDA device, of one
    float dtype they take, and the probe passed there."""
    first = tensors[0]
    if not first.is_cuda or first.dtype not in DTYPES:
        return False
    if any(t.device != first.device or t.dtype != first.dtype for t in tensors):
        return False
    return usable(first.device, first.dtype)


@functools.cache
def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Each kernel once on small inputs against its PyTorch formula; once per device and dtype."""
    problem = probe(device, dtype)
    if problem is not None:
        log.warning("fused elementwise kernels (Triton) off on %s in %s, the PyTorch ops run instead: %s",
                    device, str(dtype).removeprefix("torch."), problem)
    return problem is None


def probe(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when every kernel matches its PyTorch formula on this device and dtype, else what went wrong."""
    gen = torch.Generator().manual_seed(0)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)
    try:
        x, residual, weight = rand(3, 96), rand(3, 96), rand(96)
        total = residual + x
        want = (total.float() * torch.rsqrt(total.float().square().mean(-1, keepdim=True) + 1e-6) * weight.float())
        got = add_rms_norm(x, residual, weight, 1e-6)
        if not (torch.allclose(residual.float(), total.float(), atol=tolerance, rtol=tolerance)
                and torch.allclose(got.float(), want, atol=tolerance, rtol=tolerance)):
            return "add_rms_norm differs from PyTorch's"
        gate_up = rand(3, 2 * 40)
        gate, up = gate_up.float().chunk(2, dim=-1)
        if not torch.allclose(silu_and_mul(gate_up).float(), torch.nn.functional.silu(gate) * up,
                              atol=tolerance, rtol=tolerance):
            return "silu_and_mul differs from PyTorch's"
        heads, kv_heads, head_dim = 3, 1, 8
        qkv = rand(2, (heads + 2 * kv_heads) * head_dim)
        angles = torch.randn(2, head_dim // 2, generator=gen).to(device)
        k_cache = torch.zeros(2, 4, kv_heads, head_dim, dtype=dtype, device=device)
        v_cache = torch.zeros_like(k_cache)
        pairs = torch.view_as_complex(qkv.float().view(2, -1, head_dim // 2, 2).contiguous())
        turned = torch.view_as_real(pairs[:, :heads + kv_heads] * torch.polar(torch.ones_like(angles), angles)[:, None])
        v = qkv[:, (heads + kv_heads) * head_dim:].clone()
        rotary_write_kv(qkv, angles.cos(), angles.sin(), torch.tensor([5, 2], device=device), k_cache, v_cache,
                        heads, kv_heads)
        rotated = turned.flatten(-2)
        if not (torch.allclose(qkv[:, :(heads + kv_heads) * head_dim].float().view(2, -1, head_dim), rotated,
                               atol=tolerance, rtol=tolerance)
                and torch.allclose(k_cache.view(-1, kv_heads, head_dim)[[5, 2]].float(), rotated[:, heads:],
                                   atol=tolerance, rtol=tolerance)
                and torch.equal(v_cache.view(-1, kv_heads * head_dim)[[5, 2]], v)):
            return "rotary_write_kv differs from PyTorch's"
    except Exception as e:   # no Triton backend for this GPU, a compile error, ...
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None
