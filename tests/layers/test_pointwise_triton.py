"""The fused elementwise kernels for CUDA (pipeline/kernels/pointwise_triton.py), on the CPU
under Triton's interpreter (conftest sets TRITON_INTERPRET=1 where there is no GPU).

Each kernel against the PyTorch ops it replaces, in float32, float16 and bfloat16 (the
interpreter rounds to bfloat16 by truncation, so bf16 results are compared to within a
unit in the last place); its
start-up probe against wrong kernels; and a whole engine whose norms, SiLU and rotary cache
writes all go through them (made to serve CPU tensors here) decoding the PyTorch path's
greedy tokens.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeline import Engine, EngineConfig, Request, SamplingParams

from pipeline.kernels import cpu_kernels, cuda_kernels
from pipeline.kernels import pointwise_triton
from pipeline.layers.quantization import weight_only as wq
from pipeline.layers.attention import LayerCache
from pipeline.layers.attention.varlen import ReferenceVarlenBackend, VarlenMetadata
from pipeline.models.llama import apply_rotary

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # see conftest
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CPU = torch.device("cpu")


def tolerance(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [576, 100])   # SmolLM2-135M's hidden size; one that is no power of two
def test_add_rms_norm_equals_the_pytorch_ops(dtype, dim):
    gen = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(5, dim, generator=gen).to(dtype) for _ in range(2))
    weight = torch.randn(dim, generator=gen).to(dtype)
    total = residual + x
    want = F.rms_norm(total.float(), (dim,), weight.float(), 1e-5)
    got = pointwise_triton.add_rms_norm(x, residual, weight, 1e-5)
    if dtype == torch.bfloat16:   # the interpreter truncates to bf16 where a GPU rounds to nearest
        torch.testing.assert_close(residual.float(), total.float(), atol=0, rtol=2 ** -7)
    else:                         # the stream, updated in place, rounded as PyTorch rounds it
        assert torch.equal(residual, total)
    torch.testing.assert_close(got.float(), want, **tolerance(dtype))
    alone = pointwise_triton.add_rms_norm(x, None, weight, 1e-5)
    torch.testing.assert_close(alone.float(), F.rms_norm(x.float(), (dim,), weight.float(), 1e-5), **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1536, 40])   # SmolLM2-135M's (two column blocks); a small odd one
def test_silu_and_mul_equals_the_pytorch_ops(dtype, inter):
    gate_up = torch.randn(3, 2 * inter, generator=torch.Generator().manual_seed(1)).to(dtype)
    gate, up = gate_up.float().split(inter, dim=-1)
    got = pointwise_triton.silu_and_mul(gate_up)
    assert got.shape == (3, inter) and got.dtype == dtype
    torch.testing.assert_close(got.float(), F.silu(gate) * up, **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 16), (6, 2, 80)])   # SmolLM2-135M's; none grouped; padded
def test_rotary_write_kv_equals_rotating_then_writing(dtype, heads):
    """qkv rows a stride apart (a slice of a wider buffer), slots scattered over two pages:
    q and k rotated in place as apply_rotary rotates them, k and v where the reference
    backend's write_kv puts them, nothing else in the cache touched."""
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(2)
    tokens, width = 4, (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(tokens, width + 8, generator=gen).to(dtype)[:, :width]
    angles = torch.randn(tokens, head_dim // 2, generator=gen)
    slots = torch.tensor([17, 3, 30, 16])
    shape = (4, 8, num_kv_heads, head_dim)
    want_cache = LayerCache(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
    got_cache = LayerCache(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))

    heads_view = qkv.reshape(tokens, -1, head_dim)
    turns = torch.polar(torch.ones_like(angles), angles)[:, None]
    rotated = apply_rotary(heads_view[:, :num_heads + num_kv_heads], turns)
    v = heads_view[:, num_heads + num_kv_heads:]
    meta = VarlenMetadata(slot_mapping=slots, cu_seq_q=None, cu_seq_k=None, seqused_k=None, block_table=None,
                          max_q=1, max_k=1)
    ReferenceVarlenBackend().write_kv(want_cache, rotated[:, num_heads:], v, meta)
    got = qkv.clone()
    pointwise_triton.rotary_write_kv(got, angles.cos(), angles.sin(), slots, got_cache.k, got_cache.v,
                                     num_heads, num_kv_heads)
    got_heads = got.reshape(tokens, -1, head_dim)
    torch.testing.assert_close(got_heads[:, :num_heads + num_kv_heads].float(), rotated.float(), **tolerance(dtype))
    assert torch.equal(got_heads[:, num_heads + num_kv_heads:], v)               # v itself is not rotated
    torch.testing.assert_close(got_cache.k.float(), want_cache.k.float(), **tolerance(dtype))
    assert torch.equal(got_cache.v, want_cache.v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_probe_passes_the_kernels(dtype):
    assert pointwise_triton.probe(CPU, dtype) is None


@pytest.mark.parametrize("name", ["add_rms_norm", "silu_and_mul", "rotary_write_kv"])
def test_the_probe_names_a_wrong_kernel(monkeypatch, name):
    right = getattr(pointwise_triton, name)

    def wrong(*args):
        out = right(*args)
        if out is None:   # rotary_write_kv writes in place: spoil what it wrote
            args[0].mul_(1.5)
            return None
        return out * 1.1
    monkeypatch.setattr(pointwise_triton, name, wrong)
    assert pointwise_triton.probe(CPU, torch.float32) == f"{name} differs from PyTorch's"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_fp8_rows_computes_the_pytorch_formulas_bits_before_the_cast(dtype):
    """weight_quant.quantize_fp8_rows on the padded rows (a zero row, rows a stride apart):
    the same scales and the same values before the cast to float8, bit for bit (the
    interpreter's float8 cast is wrong, so the cast itself is checked by fp8_usable's probe
    on the GPU it runs on)."""
    gen = torch.Generator().manual_seed(2)
    wide = (torch.randn(4, 64, generator=gen) * 5).to(dtype)
    wide[2] = 0
    x = wide[:, :37]   # rows 64 apart
    got, got_scale = pointwise_triton.quantize_fp8_rows(x, 48, wq.FP8_MAX, wq.FP8_MIN_AMAX, out_dtype=torch.float32)
    padded = F.pad(x, (0, 11)).float()
    _, want_scale = wq.quantize_fp8_rows(padded)
    assert torch.equal(got_scale, want_scale) and want_scale[2].item() > 0
    assert torch.equal(got, (padded / want_scale).clamp(-wq.FP8_MAX, wq.FP8_MAX))
    assert torch.equal(got[:, 37:], torch.zeros(4, 11)) and not got[2].any()


def test_they_serve_cuda_tensors_only():
    x = torch.zeros(2, 8)
    assert not pointwise_triton.serves(x)
    assert cuda_kernels.triton_pointwise(x) is None
    assert cuda_kernels.triton_fp8_rows(x) is None


def test_an_engine_through_the_fused_kernels_decodes_the_pytorch_paths_tokens(tiny_model_dir, monkeypatch):
    """The reference backend (the varlen layout the rotary kernel writes), no C kernels: once
    with PyTorch's ops, once with every norm, SiLU and rotary write through the Triton kernels."""
    monkeypatch.setattr(cpu_kernels, "_load", lambda: None)   # as PIPELINE_CPU_KERNELS=0
    requests = [Request(f"r{i}", prompt_token_ids=list(range(100 + 7 * i, 140 + 11 * i)),
                        params=SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)) for i in range(4)]
    config = EngineConfig(device="cpu", dtype="float32", model=str(tiny_model_dir), num_kv_blocks=64, block_size=8,
                          max_num_seqs=4, pack_weights=False, attention_backend="reference",
                          batch_invariant=False)   # the mode is the cpu backend's alone
    plain = {o.id: o.token_ids for o in Engine(config).generate(requests)}
    calls = {}

    def counting(name):
        kernel = getattr(pointwise_triton, name)

        def call(*args):
            calls[name] = calls.get(name, 0) + 1
            return kernel(*args)
        return call
    fused = type("Fused", (), {name: staticmethod(counting(name))
                               for name in ("add_rms_norm", "silu_and_mul", "rotary_write_kv")})
    monkeypatch.setattr(cuda_kernels, "triton_pointwise", lambda *tensors: fused)
    assert {o.id: o.token_ids for o in Engine(config).generate(requests)} == plain
    steps = 8   # the prefill step and 7 decodes of one batch, 2 layers each
    assert calls["rotary_write_kv"] == calls["silu_and_mul"] == 2 * steps, calls
    assert calls["add_rms_norm"] == (2 * 2 + 1) * steps, calls   # two norms a layer and the final one
