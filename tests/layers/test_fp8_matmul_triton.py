"""fp8 linears' Triton product for CUDA (pipeline/kernels/fp8_matmul_triton.py), on the CPU
under Triton's interpreter (conftest sets TRITON_INTERPRET=1 where there is no GPU): against
the float64 product of the same float8 tensors at each row bound's launch, with ragged rows,
columns and K; inside Fp8Linear against its reference(); its start-up probe against a wrong
kernel. tests/layers/test_triton_compiles.py compiles every launch for sm_90."""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from pipeline.kernels import cuda_kernels
from pipeline.kernels import fp8_matmul_triton as fp8mm
from pipeline.layers.quantization import weight_only as wq

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # see conftest
CPU = torch.device("cpu")
TINY = fp8mm.Launch(16, 32, 32, 4, 2)   # several tiles on every axis of the small shapes below


def operands(m: int, n: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x8 = (torch.randn(m, k, generator=gen) * 4).to(torch.float8_e4m3fn)
    w8 = (torch.randn(n, k, generator=gen) * 4).to(torch.float8_e4m3fn)
    return x8, w8, torch.rand(m, 1, generator=gen) + 0.5, torch.rand(1, n, generator=gen) + 0.5


def exact(x8, w8, xs, ws) -> torch.Tensor:
    return (x8.double() @ w8.double().t()) * xs.double() * ws.double()


@pytest.mark.parametrize("launch", [TINY, *fp8mm.LAUNCHES.values()], ids=lambda l: f"{l.block_m}x{l.block_n}x{l.block_k}")
@pytest.mark.parametrize("m,n,k", [(1, 80, 208), (37, 53, 48), (70, 96, 256)])   # ragged M, N and K; one even K
def test_product_equals_the_float64_product_of_the_same_fp8_tensors(launch, m, n, k):
    x8, w8, xs, ws = operands(m, n, k)
    got = fp8mm.fp8_matmul(x8, w8, xs, ws, torch.float32, launch)
    want = exact(x8, w8, xs, ws)
    assert got.shape == (m, n) and got.dtype == torch.float32
    # float32 sums of exact fp8 products: far inside fp8's own error of a few percent
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4 * want.abs().max().item())


def test_bf16_output_is_the_float32_result_rounded_once():
    x8, w8, xs, ws = operands(16, 64, 96, seed=1)
    full = fp8mm.fp8_matmul(x8, w8, xs, ws, torch.float32, TINY)
    got = fp8mm.fp8_matmul(x8, w8, xs, ws, torch.bfloat16, TINY)
    assert got.dtype == torch.bfloat16
    # the interpreter truncates to bf16 where a GPU rounds to nearest: within one unit in the last place
    torch.testing.assert_close(got.float(), full, atol=0, rtol=2 ** -7)


def test_launch_for_takes_the_smallest_bound_that_holds_the_rows():
    bounds = sorted(fp8mm.LAUNCHES)
    assert fp8mm.launch_for(1) == fp8mm.LAUNCHES[bounds[0]]
    assert fp8mm.launch_for(bounds[0] + 1) == fp8mm.LAUNCHES[bounds[1]]
    assert fp8mm.launch_for(fp8mm.MAX_ROWS) == fp8mm.LAUNCHES[bounds[-1]]
    assert fp8mm.serves(fp8mm.MAX_ROWS) and not fp8mm.serves(fp8mm.MAX_ROWS + 1)


@pytest.mark.parametrize("k,n,bias", [(37, 53, True), (64, 96, False)])
def test_fp8_linear_through_the_triton_product_equals_its_reference(monkeypatch, k, n, bias):
    """The layer as a CUDA decode step would run it with the product on (made to serve CPU
    tensors here): padded K and N sliced off, the bias added, the compute dtype out."""
    linear = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        linear.weight.normal_(0, 0.05)
    layer = wq.quantized_linear("fp8", linear, CPU, torch.float32)
    calls = []
    monkeypatch.setattr(cuda_kernels, "triton_fp8_matmul", lambda x8: calls.append(x8.shape) or fp8mm)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        layer(x)
        assert calls == []   # off by default: not yet measured on a GPU
        layer.triton_product = True
        got, want = layer(x), layer.reference(x)
    assert calls == [(9, layer.weight.shape[1])] and got.shape == (9, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_product_serves_no_cpu_tensor():
    x8, *_ = operands(4, 16, 16)
    assert cuda_kernels.triton_fp8_matmul(x8) is None


def test_the_probe_passes_and_turns_a_wrong_kernel_off(monkeypatch, caplog):
    assert fp8mm.usable.__wrapped__(CPU)
    real = fp8mm.fp8_matmul
    monkeypatch.setattr(fp8mm, "fp8_matmul", lambda *args: real(*args) * 1.05)   # 5% off: a wrong epilogue
    with caplog.at_level(logging.WARNING, logger=fp8mm.__name__):
        assert not fp8mm.usable.__wrapped__(CPU)
    assert "torch._scaled_mm runs every step" in caplog.text
