"""MKL packed linear layers: same results as nn.Linear for any number of rows."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline import Engine, EngineConfig
from pipeline.packed_linear import PackedLinear, pack_linear_layers


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


def test_only_large_cpu_float32_layers_are_packed():
    model = nn.ModuleDict({"qkv_proj": nn.Linear(8, 24), "o_proj": nn.Linear(8, 8).bfloat16(),
                           "other": nn.Linear(8, 8)})
    assert pack_linear_layers(model) == 1
    assert isinstance(model["qkv_proj"], PackedLinear)
    assert type(model["o_proj"]) is nn.Linear and type(model["other"]) is nn.Linear


def test_engine_packs_cpu_float32_weights_unless_told_not_to(tiny_model_dir):
    packed = Engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=16))
    plain = Engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=16, pack_weights=False))
    assert isinstance(packed.model.model.layers[0].mlp.gate_up_proj, PackedLinear)
    assert isinstance(packed.model.lm_head, PackedLinear)
    assert type(plain.model.model.layers[0].mlp.gate_up_proj) is nn.Linear
    from pipeline import Request, SamplingParams
    request = Request("r", prompt="The capital of France is", params=SamplingParams(max_tokens=12, temperature=0))
    assert next(packed.generate([request])).token_ids == next(plain.generate([request])).token_ids


def test_weights_stay_unpacked_when_memory_is_short(monkeypatch):
    from pipeline import packed_linear
    model = nn.ModuleDict({"qkv_proj": nn.Linear(64, 192)})
    monkeypatch.setattr(packed_linear, "_available_memory", lambda: 100_000)   # bytes
    assert pack_linear_layers(model) == 0
    assert type(model["qkv_proj"]) is nn.Linear
