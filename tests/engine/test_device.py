"""dtype "auto" and the device: the model's own dtype where the device computes it
natively, float32 otherwise (but bf16 for a float32 checkpoint on a GPU with bf16); loading
allocates the weights once, in the target dtype."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch import nn

from pipeline import Engine, EngineConfig, device
from pipeline.device import cpu_has_native_bf16, resolve_dtype

CPU = torch.device("cpu")


def test_auto_is_the_default_dtype():
    assert EngineConfig().dtype == "auto"


@pytest.mark.parametrize("native, saved, expected", [
    (True, "bfloat16", torch.bfloat16), (False, "bfloat16", torch.float32),
    (True, "float16", torch.float32),     # fp16 is emulated on every CPU
    (True, "float32", torch.float32), (True, None, torch.float32)])
def test_auto_on_the_cpu_takes_the_model_dtype_only_where_it_is_native(monkeypatch, native, saved, expected):
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: native)
    config = {} if saved is None else {"torch_dtype": saved}
    assert resolve_dtype("auto", CPU, config) == expected
    # transformers >= 5 writes "dtype" instead of "torch_dtype"
    assert resolve_dtype("auto", CPU, {} if saved is None else {"dtype": saved}) == expected


@pytest.mark.parametrize("bf16, saved, expected", [
    (True, "float32", torch.bfloat16),    # FlashAttention and CUDA graphs, half the bytes a step
    (True, None, torch.bfloat16), (True, "bfloat16", torch.bfloat16), (True, "float16", torch.float16),
    (False, "float32", torch.float32),    # no bf16 on the GPU: float16's range is too narrow for it
    (False, "bfloat16", torch.float32), (False, "float16", torch.float16)])
def test_auto_on_cuda_runs_a_float32_checkpoint_in_bf16_where_the_gpu_has_it(monkeypatch, bf16, saved, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16)
    config = {} if saved is None else {"torch_dtype": saved}
    assert resolve_dtype("auto", torch.device("cuda"), config) == expected
    assert resolve_dtype("float32", torch.device("cuda"), config) == torch.float32


def test_an_explicit_dtype_is_kept(monkeypatch):
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: False)
    assert resolve_dtype("bfloat16", CPU, {"torch_dtype": "float32"}) == torch.bfloat16
    assert resolve_dtype("float32", CPU, {"torch_dtype": "bfloat16"}) == torch.float32


def test_native_bf16_detection_agrees_with_the_cpu_flags():
    """PyTorch's probe and /proc/cpuinfo must agree on this machine: AVX-512 BF16 or AMX."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    assert cpu_has_native_bf16() == any(f in flags for f in ("avx512_bf16", "amx_bf16"))


def test_native_bf16_detection_falls_back_to_the_cpu_flags(monkeypatch, tmp_path):
    """A PyTorch without its private probes: the flags decide."""
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported", raising=False)
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    cpuinfo = tmp_path / "cpuinfo"
    real_open = open

    def fake_open(path, *args, **kwargs):
        return real_open(cpuinfo if path == "/proc/cpuinfo" else path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", fake_open)
    try:
        for line, expected in (("flags : fpu sse avx512f amx_bf16 amx_tile\n", True),
                               ("flags : fpu sse avx2 avx512f\n", False)):
            cpuinfo.write_text("processor : 0\n" + line)
            cpu_has_native_bf16.cache_clear()
            assert cpu_has_native_bf16() is expected
    finally:
        cpu_has_native_bf16.cache_clear()


@pytest.fixture(scope="module")
def tiny_bf16_model_dir(tmp_path_factory, tiny_model_dir):
    """The tiny model saved as a bf16 checkpoint would be: config says bfloat16."""
    out = tmp_path_factory.mktemp("tiny-bf16")
    for path in tiny_model_dir.iterdir():
        shutil.copy(path, out / path.name)
    config = json.loads((out / "config.json").read_text())
    config.pop("torch_dtype", None)
    config["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_engine_auto_dtype_follows_the_model_and_the_cpu(tiny_model_dir, tiny_bf16_model_dir):
    assert Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), num_kv_blocks=8)).dtype == torch.float32
    engine = Engine(EngineConfig(device="cpu", model=str(tiny_bf16_model_dir), num_kv_blocks=8))
    expected = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert engine.dtype == expected
    assert engine.model.model.embed_tokens.weight.dtype == expected
    assert engine.runner.kv_cache.k.dtype == expected


def test_weights_are_materialised_in_the_target_dtype(tiny_model_dir, monkeypatch):
    """Cast on the meta device, then allocate: no float32 copy of a bf16 model ever exists."""
    seen = []
    to_empty = nn.Module.to_empty

    def recording_to_empty(module, *args, **kwargs):
        seen.extend(p.dtype for p in module.parameters())
        return to_empty(module, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "to_empty", recording_to_empty)
    engine = Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), dtype="bfloat16", num_kv_blocks=8,
                                 pack_weights=False))
    assert seen and set(seen) == {torch.bfloat16}
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
