"""fp8 linears' product for decode steps on CUDA, in Triton: y = (x8 @ w8^T) * x_scale * w_scale.

weight_only.Fp8Linear quantizes each token's activations to float8 e4m3 with a scale of its
own and holds e4m3 weights with a scale per output channel; `torch._scaled_mm` with row-wise
scales multiplies them. On an H200 (torch 2.11, benchmarks/gpu_check.py) cuBLAS chose 128 x
128 tiles for a Llama-3.2-1B layer's products at 256 rows, so a q/k/v projection is 2 x 24
tiles for 132 SMs; in a CUDA graph (its weights in L2) the layer's four products took 55 us
at 256 rows (bf16: 63) and 54 us at 16 (bf16: 41), where its 61 MB of fp8 weights would take
14 us from HBM at 4.3 TB/s. This kernel takes tiles sized to the rows (LAUNCHES), so that a
decode step's product can keep every SM busy, and launches the tiles of one column panel
side by side, so that the panel is read from HBM once and its other reads hit L2.

It has not run on a GPU yet: Fp8Linear.triton_product keeps it off until
benchmarks/fp8_matmul_sweep.py has chosen LAUNCHES there and measured it against
`_scaled_mm` end to end.

It accumulates in float32 (FP8 tensor cores, wgmma where the tile allows) and applies both
scales to the float32 sum before the one rounding to the output dtype: Fp8Linear.reference()'s
arithmetic. Steps of more than MAX_ROWS rows (prefill chunks: compute-bound, where cuBLAS's
large tiles are right) stay on `_scaled_mm`.

`usable(device)` runs it once against `_scaled_mm` on the device (said once in the log and
False if it differs or does not compile); on a CPU it runs only under Triton's interpreter
(the tests).
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

log = logging.getLogger(__name__)
MAX_ROWS = 256   # more rows (prefill chunks) go to _scaled_mm


@dataclass(frozen=True)
class Launch:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# By the step's rows (the smallest bound that holds them): tiles as wide as the rows need,
# narrow enough in N for every SM to get one. First guesses (each compiles for sm_90 without
# spills: tests/triton_compile_check.py), until benchmarks/fp8_matmul_sweep.py chooses them on
# a GPU from a 1B layer's four linears at 1, 16, 64, 128 and 256 rows.
LAUNCHES: dict[int, Launch] = {
    16: Launch(16, 64, 256, 4, 4),
    64: Launch(64, 64, 128, 4, 4),
    128: Launch(64, 128, 128, 4, 4),
    256: Launch(64, 128, 128, 4, 4),
}


def launch_for(rows: int) -> Launch:
    return LAUNCHES[next(bound for bound in sorted(LAUNCHES) if rows <= bound)]


@triton.jit
def _fp8_matmul_kernel(x_ptr, w_ptr, x_scale_ptr, w_scale_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_out,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    # The M tiles of one column panel are consecutive programs: they run together and share its reads.
    num_m = tl.cdiv(M, BLOCK_M)
    pid = tl.program_id(0)
    pid_m, pid_n = pid % num_m, pid // num_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_x + rk[None, :]
    w_ptrs = w_ptr + rn[None, :].to(tl.int64) * stride_w + rk[:, None]    # [BLOCK_K, BLOCK_N], K-major
    m_ok, n_ok = rm[:, None] < M, rn[None, :] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=m_ok, other=0.0)
            b = tl.load(w_ptrs, mask=n_ok, other=0.0)
        else:
            a = tl.load(x_ptrs, mask=m_ok & (rk[None, :] < K - k), other=0.0)
            b = tl.load(w_ptrs, mask=n_ok & (rk[:, None] < K - k), other=0.0)
        acc = tl.dot(a, b, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    x_scale = tl.load(x_scale_ptr + rm, mask=rm < M, other=0.0)
    w_scale = tl.load(w_scale_ptr + rn, mask=rn < N, other=0.0)
    y = acc * x_scale[:, None] * w_scale[None, :]
    tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_out + rn[None, :], y.to(out_ptr.dtype.element_ty),
             mask=m_ok & n_ok)


def fp8_matmul(x8: torch.Tensor, weight: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
               out_dtype: torch.dtype, launch: Launch | None = None) -> torch.Tensor:
    """x8 [M, K] and weight [N, K] float8 e4m3 (rows contiguous), x_scale [M, 1] and w_scale
    [1, N] float32 -> (x8 @ weight^T) * x_scale * w_scale [M, N] in out_dtype."""
    (m, k), n = x8.shape, weight.shape[0]
    if weight.shape[1] != k or x8.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(f"fp8_matmul: x8 {tuple(x8.shape)} and weight {tuple(weight.shape)} need the same K "
                         f"and contiguous rows")
    launch = launch or launch_for(m)
    out = torch.empty((m, n), dtype=out_dtype, device=x8.device)
    grid = (triton.cdiv(m, launch.block_m) * triton.cdiv(n, launch.block_n),)
    _fp8_matmul_kernel[grid](x8, weight, x_scale, w_scale, out, m, n, k, x8.stride(0), weight.stride(0), out.stride(0),
                             BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
                             EVEN_K=k % launch.block_k == 0, num_warps=launch.num_warps, num_stages=launch.num_stages)
    return out


def serves(rows: int) -> bool:
    return rows <= MAX_ROWS


@functools.cache
def usable(device: torch.device) -> bool:
    """fp8_matmul once at each row bound against `_scaled_mm` on this device (a ragged K and
    N included): within bf16 rounding, else said once in the log and False."""
    gen = torch.Generator().manual_seed(0)
    problem = None
    try:
        for rows in sorted(LAUNCHES):
            x = torch.randn(rows, 208, generator=gen).to(device, torch.float8_e4m3fn)
            w = torch.randn(80, 208, generator=gen).to(device, torch.float8_e4m3fn)
            xs = (torch.rand(rows, 1, generator=gen) + 0.5).to(device)
            ws = (torch.rand(1, 80, generator=gen) + 0.5).to(device)
            got = fp8_matmul(x, w, xs, ws, torch.bfloat16).float()
            want = torch._scaled_mm(x, w.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16).float()
            if not torch.allclose(got, want, rtol=1e-2, atol=1e-2):
                problem = f"{rows} rows: {(got - want).abs().max().item():.3g} from _scaled_mm"
                break
    except Exception as e:   # a compile error, no FP8 tensor cores, ...
        problem = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if problem is not None:
        log.warning("fp8 product (Triton) off on %s, torch._scaled_mm runs every step: %s", device, problem)
    return problem is None
