"""Packed linear layers (MKL for float32, oneDNN for bfloat16): the same results as
nn.Linear for any number of rows."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeline import Engine, EngineConfig
from pipeline.device import cpu_has_native_bf16
from pipeline.layers.packed_linear import OneDnnLinear, PackedLinear, pack_linear_layers


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [0, 1, 3, 8, 64, 65, 300])
def test_packed_linear_matches_nn_linear(rows, bias):
    torch.manual_seed(0)
    linear = nn.Linear(96, 200, bias=bias)
    packed = PackedLinear(linear)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
        # Leading dimensions and a non-contiguous input are handled too.
        x3 = torch.randn(2, 96, rows).transpose(1, 2)
        torch.testing.assert_close(packed(x3), linear(x3), rtol=1e-5, atol=1e-5)


native_bf16 = pytest.mark.skipif(not cpu_has_native_bf16(), reason="no AVX-512 BF16 / AMX on this CPU")


@native_bf16
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [0, 1, 3, 8, 64, 65, 300])
def test_onednn_bf16_linear_matches_nn_linear_exactly(rows, bias):
    """oneDNN's blocked layout changes where the weights sit, not the arithmetic: without a
    bias the very same bits; a bias is added in float32 before the one rounding (nn.Linear
    rounds x @ W^T first), so those results are within one bf16 rounding of float32's."""
    torch.manual_seed(0)
    linear = nn.Linear(96, 200, bias=bias).bfloat16()
    packed = OneDnnLinear(linear)
    x = torch.randn(rows, 96).bfloat16()
    x3 = torch.randn(2, 96, rows).bfloat16().transpose(1, 2)
    with torch.inference_mode():
        for inputs in (x, x3):    # leading dimensions and a non-contiguous input too
            got = packed(inputs)
            if bias:
                exact = F.linear(inputs.float(), linear.weight.float(), linear.bias.float())
                torch.testing.assert_close(got.float(), exact, rtol=2 ** -8, atol=1e-6)
            else:
                torch.testing.assert_close(got, linear(inputs), rtol=0, atol=0)


def test_only_large_cpu_float32_and_native_bf16_layers_are_packed():
    model = nn.ModuleDict({"qkv_proj": nn.Linear(8, 24), "o_proj": nn.Linear(8, 8).bfloat16(),
                           "down_proj": nn.Linear(8, 8).half(), "other": nn.Linear(8, 8)})
    assert pack_linear_layers(model) == (2 if cpu_has_native_bf16() else 1)
    assert isinstance(model["qkv_proj"], PackedLinear)
    # bf16 without native support is emulated by oneDNN: a plain matmul is no slower there.
    assert isinstance(model["o_proj"], OneDnnLinear if cpu_has_native_bf16() else nn.Linear)
    assert type(model["down_proj"]) is nn.Linear and type(model["other"]) is nn.Linear


# The layers sit inside batch-invariant wrappers (pipeline/layers/batch_invariant.py): `.inner`.
def test_engine_packs_cpu_float32_weights_unless_told_not_to(tiny_model_dir):
    packed = Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), num_kv_blocks=16))
    plain = Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), num_kv_blocks=16, pack_weights=False))
    assert isinstance(packed.model.model.layers[0].mlp.gate_up_proj.inner, PackedLinear)
    assert isinstance(packed.model.lm_head.inner, PackedLinear)
    assert type(plain.model.model.layers[0].mlp.gate_up_proj.inner) is nn.Linear
    from pipeline import Request, SamplingParams
    request = Request("r", prompt="The capital of France is", params=SamplingParams(max_tokens=12, temperature=0))
    assert next(packed.generate([request])).token_ids == next(plain.generate([request])).token_ids


@native_bf16
def test_engine_packs_bf16_weights_with_onednn(tiny_model_dir):
    packed = Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), dtype="bfloat16", num_kv_blocks=16))
    plain = Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), dtype="bfloat16", num_kv_blocks=16,
                                pack_weights=False))
    assert isinstance(packed.model.model.layers[0].self_attn.qkv_proj.inner, OneDnnLinear)
    assert isinstance(packed.model.lm_head.inner, OneDnnLinear)
    from pipeline import Request, SamplingParams
    request = Request("r", prompt="The capital of France is", params=SamplingParams(max_tokens=12, temperature=0))
    assert next(packed.generate([request])).token_ids == next(plain.generate([request])).token_ids


def test_weights_stay_unpacked_when_memory_is_short(monkeypatch):
    from pipeline.layers import packed_linear
    model = nn.ModuleDict({"qkv_proj": nn.Linear(64, 192)})
    monkeypatch.setattr(packed_linear, "_available_memory", lambda: 100_000)   # bytes
    assert pack_linear_layers(model) == 0
    assert type(model["qkv_proj"]) is nn.Linear
