"""The C kernels (pipeline/kernels): decode attention over the paged KV cache, the fused
residual-add RMSNorm, rotary + KV write and SiLU-and-multiply, in float32 and bfloat16,
each against a plain PyTorch reference, and the fallback when no compiler is available."""
from __future__ import annotations

import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipeline.kernels import cpu_kernels
from pipeline.layers.attention.cpu_paged import DecodeLayout, decode_attention_torch, gather_context


def random_paged_batch(num_heads, num_kv_heads, head_dim, block_size, lens, seed=0):
    """A shuffled block pool holding random keys/values for sequences of the given lengths."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_needed) + 3   # spare blocks hold garbage that must never be read
    k_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=gen)
    order = list(range(num_blocks))
    random.Random(seed).shuffle(order)
    tables, start = [], 0
    for n in blocks_needed:
        tables.append(order[start:start + n])
        start += n
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen)
    return q, k_cache, v_cache, tables


def dense_reference(q, k_cache, v_cache, tables, lens, scale):
    out = []
    for i, (table, n) in enumerate(zip(tables, lens)):
        k = gather_context(k_cache, torch.tensor(table), n)      # [kv_heads, n, head_dim]
        v = gather_context(v_cache, torch.tensor(table), n)
        o = F.scaled_dot_product_attention(q[i].unsqueeze(1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                           scale=scale, enable_gqa=True)
        out.append(o[0, :, 0])
    return torch.stack(out)


SHAPES = [(4, 4, 64), (9, 3, 64), (8, 2, 128), (6, 2, 80), (4, 2, 16)]
LENS = [1, 15, 16, 17, 33, 200, 2]


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", SHAPES)
@pytest.mark.parametrize("block_size", [16, 5])
def test_decode_attention_matches_a_dense_reference(num_heads, num_kv_heads, head_dim, block_size):
    q, k_cache, v_cache, tables = random_paged_batch(num_heads, num_kv_heads, head_dim, block_size, LENS)
    scale = head_dim ** -0.5
    expected = dense_reference(q, k_cache, v_cache, tables, LENS, scale)
    layout = DecodeLayout.build(tables, LENS, block_size, torch.device("cpu"))

    torch.testing.assert_close(decode_attention_torch(q, k_cache, v_cache, layout, scale), expected)
    # q as the model passes it: a strided slice of the fused q/k tensor.
    fused = torch.cat([q, torch.randn(len(LENS), num_kv_heads, head_dim)], dim=1)
    got = cpu_kernels.paged_decode_attention(fused[:, :num_heads], k_cache, v_cache,
                                         layout.block_tables, layout.context_lens, scale)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", SHAPES)
def test_bf16_decode_attention_matches_a_float32_reference(num_heads, num_kv_heads, head_dim):
    """bf16 caches and queries, float32 arithmetic: as close to the float32 reference on the
    same (bf16-rounded) inputs as one bf16 rounding of the output, and as close as the
    PyTorch bf16 path."""
    q, k_cache, v_cache, tables = random_paged_batch(num_heads, num_kv_heads, head_dim, 16, LENS)
    q, k_cache, v_cache = q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    scale = head_dim ** -0.5
    expected = dense_reference(q.float(), k_cache.float(), v_cache.float(), tables, LENS, scale)
    layout = DecodeLayout.build(tables, LENS, 16, torch.device("cpu"))
    fused = torch.cat([q, torch.randn(len(LENS), num_kv_heads, head_dim).bfloat16()], dim=1)
    got = cpu_kernels.paged_decode_attention(fused[:, :num_heads], k_cache, v_cache,
                                         layout.block_tables, layout.context_lens, scale)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, rtol=8e-3, atol=1e-3)   # bf16's half ulp is 2**-9
    torch_path = decode_attention_torch(q, k_cache, v_cache, layout, scale)
    torch.testing.assert_close(torch_path.float(), expected, rtol=8e-3, atol=1e-3)


def test_bf16_rounding_is_round_to_nearest_even_like_pytorch():
    """The kernels' float32 -> bf16 narrowing (bf16.h) against PyTorch's, through the fused
    residual add: exact ties (to even), overflow to infinity, NaN, tiny values."""
    tie = 2.0 ** -8                       # half an ulp of bf16 at 1.0
    residual = torch.tensor([1.0, 1.0, 1.0, 3e38, -3e38, float("nan"), 1e-38, 1.0, 0.0]).bfloat16()
    x = torch.tensor([tie, 3 * tie, -tie / 2, 3e38, -3e38, 1.0, 1e-39, float("inf"), -0.0]).bfloat16()
    expected = residual + x
    got = residual.clone().view(1, -1)
    cpu_kernels.add_rms_norm(x.view(1, -1), got, torch.ones(9).bfloat16(), 1e-5)
    assert got.view(-1).view(torch.int16).tolist() == expected.view(torch.int16).tolist()


@pytest.mark.parametrize("rows", [1, 7, 100])
def test_bf16_add_rms_norm_matches_pytorch(rows):
    torch.manual_seed(0)
    x, residual, weight = (torch.randn(rows, 96).bfloat16(), torch.randn(rows, 96).bfloat16(),
                           torch.randn(96).bfloat16())
    expected_residual = residual + x                      # bf16 add: float32, rounded once
    expected = F.rms_norm(expected_residual.float(), (96,), weight.float(), 1e-5)
    out = cpu_kernels.add_rms_norm(x, residual, weight, 1e-5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(residual, expected_residual, rtol=0, atol=0)   # updated in place, exactly
    torch.testing.assert_close(out.float(), expected, rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(cpu_kernels.add_rms_norm(x, None, weight, 1e-5).float(),
                               F.rms_norm(x.float(), (96,), weight.float(), 1e-5), rtol=8e-3, atol=1e-5)


def test_bf16_silu_and_mul_matches_pytorch():
    gate = torch.cat([torch.linspace(-100, 100, 20_000), torch.randn(20_000) * 4]).view(-1, 400).bfloat16()
    up = torch.randn_like(gate)
    got = cpu_kernels.silu_and_mul(torch.cat([gate, up], dim=1))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), F.silu(gate.float()) * up.float(), rtol=8e-3, atol=1e-30)


@pytest.mark.parametrize("rows", [1, 7, 100])
def test_add_rms_norm_matches_pytorch(rows):
    torch.manual_seed(0)
    x, residual, weight = torch.randn(rows, 96), torch.randn(rows, 96), torch.randn(96)
    expected_residual = residual + x
    expected = F.rms_norm(expected_residual, (96,), weight, 1e-5)
    torch.testing.assert_close(cpu_kernels.add_rms_norm(x, None, weight, 1e-5), F.rms_norm(x, (96,), weight, 1e-5))
    out = cpu_kernels.add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(residual, expected_residual)   # updated in place


def test_silu_and_mul_matches_pytorch_over_the_float_range():
    gate = torch.cat([torch.linspace(-100, 100, 20_000), torch.randn(20_000) * 4]).view(-1, 400)
    up = torch.randn_like(gate)
    got = cpu_kernels.silu_and_mul(torch.cat([gate, up], dim=1))
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_write_kv_matches_pytorch(dtype):
    from pipeline.layers.attention.cpu_paged import cache_rows, write_kv
    from pipeline.models.llama import Rotation, apply_rotary
    heads, kv_heads, head_dim, block_size, tokens = 6, 2, 16, 4, 9
    torch.manual_seed(0)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    angles = torch.rand(tokens, head_dim // 2) * 6
    rotation = Rotation(angles.cos(), angles.sin())
    rows = torch.from_numpy(cache_rows(np.array([5, 6, 7, 8, 9, 10, 11, 0, 1]), kv_heads, block_size))
    caches = [torch.zeros(4, kv_heads, block_size, head_dim, dtype=dtype) for _ in range(4)]

    view = qkv.clone().view(tokens, -1, head_dim)
    qk = apply_rotary(view[:, :heads + kv_heads], rotation.complex)
    write_kv(caches[0], rows, qk[:, heads:])
    write_kv(caches[1], rows, view[:, heads + kv_heads:])
    got = qkv.clone()
    cpu_kernels.rotary_write_kv(got, rotation.cos, rotation.sin, rows, caches[2], caches[3], heads, kv_heads)
    got = got.view(tokens, -1, head_dim)
    torch.testing.assert_close(got[:, :heads + kv_heads], qk)
    torch.testing.assert_close(got[:, heads + kv_heads:], view[:, heads + kv_heads:])   # v untouched
    torch.testing.assert_close(caches[2], caches[0])
    torch.testing.assert_close(caches[3], caches[1])


def test_the_kernel_builds_here_and_serves_cpu_float32_and_bfloat16_only():
    """The test machine has a C compiler: the fast path must actually be the one tested."""
    q, k_cache = torch.zeros(1, 4, 64), torch.zeros(2, 2, 16, 64)
    assert cpu_kernels.can_run_paged_decode_attention(q, k_cache)
    assert cpu_kernels.can_run_paged_decode_attention(q.bfloat16(), k_cache.bfloat16())
    assert not cpu_kernels.can_run_paged_decode_attention(q.half(), k_cache.half())
    assert not cpu_kernels.can_run_paged_decode_attention(q.bfloat16(), k_cache)
    assert not cpu_kernels.can_run_paged_decode_attention(torch.zeros(1, 4, 60), torch.zeros(2, 2, 16, 60))
    assert cpu_kernels.serves(q, k_cache) and cpu_kernels.serves(q.bfloat16(), k_cache.bfloat16())
    assert not cpu_kernels.serves(q.half()) and not cpu_kernels.serves(q, k_cache.bfloat16())
    assert not cpu_kernels.serves(torch.zeros(4, 8).t())


def test_without_a_compiler_the_pytorch_path_is_used(tmp_path):
    """No compiler and no cached build: the kernel is unavailable, nothing fails."""
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), PIPELINE_CACHE_DIR=str(tmp_path))
    code = ("import torch; from pipeline.kernels import cpu_kernels; "
            "print(cpu_kernels.can_run_paged_decode_attention(torch.zeros(1, 4, 64), torch.zeros(2, 2, 16, 64)))")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
    assert "PyTorch path" in result.stderr


# ---- INT8 KV cache (pipeline/layers/quantization/int8_kv_cache.py) --------------------------------------------------

def test_int8_round_trip_error_is_at_most_half_a_step():
    from pipeline.layers.quantization.int8_kv_cache import dequantize, quantize
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=gen) * torch.logspace(-3, 3, 50).view(50, 1, 1)
    x[0, 0] = 0.0                                  # an all-zero head stays exactly zero
    x8, scales = quantize(x)
    assert x8.dtype == torch.int8 and scales.shape == (50, 3)
    assert x8.abs().max() == 127
    back = dequantize(x8, scales)
    assert torch.all(back[0, 0] == 0)
    bound = scales.unsqueeze(-1) / 2 * (1 + 1e-5)
    assert torch.all((back - x).abs() <= bound)
    # relative to each head's largest value: at most 1/254
    assert ((back - x).abs().amax(-1) / x.abs().amax(-1).clamp_min(1e-30)).max() <= 1 / 254 + 1e-6


def int8_paged_batch(num_heads, num_kv_heads, head_dim, block_size, lens):
    from pipeline.layers.quantization.int8_kv_cache import quantize
    q, k_cache, v_cache, tables = random_paged_batch(num_heads, num_kv_heads, head_dim, block_size, lens)
    (k8, ks), (v8, vs) = quantize(k_cache * 3), quantize(v_cache)
    return q, k8, ks, v8, vs, tables


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_decode_attention_matches_the_dequantized_reference(num_heads, num_kv_heads, head_dim, dtype):
    """The kernel reads int8 blocks and their scales in place; the PyTorch path dequantizes
    the blocks it gathers; both equal dense attention over the dequantized cache."""
    from pipeline.layers.quantization.int8_kv_cache import dequantize
    q, k8, ks, v8, vs, tables = int8_paged_batch(num_heads, num_kv_heads, head_dim, 16, LENS)
    q = q.to(dtype)
    scale = head_dim ** -0.5
    expected = dense_reference(q.float(), dequantize(k8, ks), dequantize(v8, vs), tables, LENS, scale)
    layout = DecodeLayout.build(tables, LENS, 16, torch.device("cpu"))
    assert cpu_kernels.can_run_paged_decode_attention(q, k8)
    got = cpu_kernels.paged_decode_attention(q, k8, v8, layout.block_tables, layout.context_lens, scale,
                                         k_scales=ks, v_scales=vs)
    torch_path = decode_attention_torch(q, k8, v8, layout, scale, ks, vs)
    tol = dict(rtol=8e-3, atol=1e-3) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.float(), expected, **tol)
    torch.testing.assert_close(torch_path.float(), expected, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_rotary_write_kv_quantizes_like_pytorch(dtype):
    """Same formula on both paths; the rotated keys themselves may differ in the last bit
    (FMA), so a key may round to the neighbouring int8 and its scale differ by an ulp."""
    from pipeline.layers.attention.cpu_paged import cache_rows, write_kv
    from pipeline.models.llama import Rotation, apply_rotary
    heads, kv_heads, head_dim, block_size, tokens = 6, 2, 16, 4, 9
    torch.manual_seed(0)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim) * 5).to(dtype)
    angles = torch.rand(tokens, head_dim // 2) * 6
    rotation = Rotation(angles.cos(), angles.sin())
    rows = torch.from_numpy(cache_rows(np.array([5, 6, 7, 8, 9, 10, 11, 0, 1]), kv_heads, block_size))
    caches = [torch.zeros(4, kv_heads, block_size, head_dim, dtype=torch.int8) for _ in range(4)]
    scales = [torch.zeros(4, kv_heads, block_size) for _ in range(4)]

    view = qkv.clone().view(tokens, -1, head_dim)
    qk = apply_rotary(view[:, :heads + kv_heads], rotation.complex)
    write_kv(caches[0], rows, qk[:, heads:], scales[0])
    write_kv(caches[1], rows, view[:, heads + kv_heads:], scales[1])
    got = qkv.clone()
    cpu_kernels.rotary_write_kv(got, rotation.cos, rotation.sin, rows, caches[2], caches[3], heads, kv_heads,
                            scales[2], scales[3])
    torch.testing.assert_close(got.view(tokens, -1, head_dim)[:, :heads + kv_heads], qk)
    assert torch.equal(caches[3], caches[1]) and torch.equal(scales[3], scales[1])   # v is not rotated
    assert (caches[2].int() - caches[0].int()).abs().max() <= 1
    torch.testing.assert_close(scales[2], scales[0])
    assert scales[0].count_nonzero() == tokens * kv_heads
