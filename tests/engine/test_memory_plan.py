"""The CUDA memory plan (pipeline/engine/memory_budget.py, memory_profile.py), on a CPU: its
arithmetic on fake device numbers, the one-line errors of a model that does not fit, the
order of the measurements, and the profiling step itself run on the tiny model."""
from __future__ import annotations

import logging

import pytest
import torch

from pipeline import Engine, EngineConfig
from pipeline.engine import memory_profile
from pipeline.engine.memory_budget import GpuBudget, cache_summary, gpu_budget, weights_must_fit
from pipeline.engine.memory_profile import step_lengths, step_peak_bytes
from pipeline.layers.kv_cache import KVCache

GIB, MIB = 2**30, 2**20
H200 = 140 * GIB
BLOCK = 16
PER_BLOCK = 2 * 16 * BLOCK * 8 * 64 * 2   # a Llama-3.2-1B block: k and v, 16 layers, 8 KV heads of 64, bf16


def test_the_cache_takes_the_share_less_what_is_in_use_and_the_measured_peak():
    gpu = GpuBudget(total=H200, free=H200 - 4 * GIB, utilization=0.9, activation_peak=3 * GIB, step_tokens=8192)
    assert gpu.in_use == 4 * GIB
    assert gpu.cache_bytes == int(H200 * 0.9) - 4 * GIB - 3 * GIB
    assert gpu.num_blocks(PER_BLOCK, BLOCK) == gpu.cache_bytes // PER_BLOCK
    # another process holding memory leaves the cache less, never an overcommitted device
    crowded = GpuBudget(H200, H200 - 14 * GIB, 0.9, 3 * GIB, 8192)
    assert crowded.cache_bytes == gpu.cache_bytes - 10 * GIB
    # a larger step's peak comes off the cache byte for byte
    assert GpuBudget(H200, H200 - 4 * GIB, 0.9, 5 * GIB, 16384).cache_bytes == gpu.cache_bytes - 2 * GIB


def test_a_backend_that_copies_a_layer_out_leaves_room_for_that_copy():
    plain = GpuBudget(H200, H200 - 4 * GIB, 0.9, GIB, 8192)
    copying = GpuBudget(H200, H200 - 4 * GIB, 0.9, GIB, 8192, num_layers=16)
    assert copying.cache_bytes == plain.cache_bytes * 16 // 17
    assert plain.cache_bytes - copying.cache_bytes >= copying.cache_bytes // 16   # one layer's share of the cache


@pytest.mark.parametrize("in_use, peak", [(int(0.95 * H200), GIB),        # the weights take nearly everything
                                          (120 * GIB, 7 * GIB),            # room, but not beside the step's peak
                                          (int(H200 * 0.9) - GIB - PER_BLOCK // 2, GIB)])   # half a block left
def test_a_model_that_does_not_fit_says_so_in_one_line_with_the_numbers(in_use, peak):
    gpu = GpuBudget(H200, H200 - in_use, 0.9, peak, 8192)
    assert gpu.cache_bytes < PER_BLOCK
    with pytest.raises(ValueError) as e:
        gpu.num_blocks(PER_BLOCK, BLOCK)
    message = str(e.value)
    assert "\n" not in message and message.startswith("the model does not fit")
    for figure in ("90% of 140.0 GiB is 126.0 GiB", f"hold {gpu.in_use / GIB:.1f} GiB", "a step of 8,192 tokens",
                   f"peaks at {peak / GIB:.2f} GiB (measured)",
                   f"for the KV cache (one block of 16 tokens takes {PER_BLOCK / MIB:.2f} MiB)",
                   "gpu_memory_utilization", "max_num_batched_tokens", "kv_cache_gib"):
        assert figure in message, (figure, message)


def test_the_start_up_line_has_blocks_tokens_and_sequences_of_max_model_len():
    line = cache_summary(1000, 16, PER_BLOCK, 4096)
    assert line == f"KV cache: 1,000 blocks of 16 tokens = 16,000 tokens ({1000 * PER_BLOCK / GIB:.2f} GiB), " \
                   "3.9 sequences of max_model_len 4,096"
    gpu = GpuBudget(H200, H200 - 4 * GIB, 0.9, 3 * GIB, 8192)
    line = cache_summary(gpu.num_blocks(PER_BLOCK, BLOCK), BLOCK, PER_BLOCK, 4096, gpu)
    assert "\n" not in line and "sequences of max_model_len 4,096" in line
    assert line.endswith("; 90% of 140.0 GiB, 4.0 GiB in use after loading, a step of 8,192 tokens peaks at "
                         "3.00 GiB (measured)")


def test_the_step_is_profiled_before_the_free_memory_is_read(monkeypatch):
    """The profiling step first, then PyTorch's cache handed back (mem_get_info counts it as
    used), then the device's free memory: the budget is what the loaded model and that step
    leave."""
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: calls.append("mem_get_info") or
                        (70 * GIB, 80 * GIB))

    def profile(tokens: int) -> int:
        calls.append(f"profile {tokens}")
        return 2 * GIB

    config = EngineConfig(gpu_memory_utilization=0.8, max_num_batched_tokens=4096)
    gpu = gpu_budget(config, torch.device("cuda"), profile, num_layers=16, copies_layer_kv=False)
    assert calls == ["profile 4096", "synchronize", "empty_cache", "mem_get_info"]
    assert gpu == GpuBudget(80 * GIB, 70 * GIB, 0.8, 2 * GIB, 4096, 0)
    assert gpu_budget(config, torch.device("cuda"), profile, 16, copies_layer_kv=True).num_layers == 16


def test_a_step_splits_its_tokens_over_the_batch():
    assert step_lengths(8192, 256) == [32] * 256
    assert step_lengths(10, 4) == [3, 3, 2, 2] and step_lengths(3, 256) == [1, 1, 1]


def test_the_profiling_step_runs_the_model_and_the_sampler_on_every_token(tiny_model_dir, monkeypatch):
    """The dummy step goes through the real model runner and sampler: max_num_batched_tokens
    rows in one forward, every sequence sampling, and the scratch cache let go after."""
    engine = Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), dtype="float32", kv_cache_gib=0.05))
    rows, sampled = [], []
    engine.model.model.embed_tokens.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[0]))
    sample = memory_profile.Sampler.__call__
    monkeypatch.setattr(memory_profile.Sampler, "__call__",
                        lambda self, logits, seqs: sampled.append((tuple(logits.shape), len(seqs))) or
                        sample(self, logits, seqs))
    measured = []

    def peak_of(device, run):
        run()
        measured.append(device)
        return 12345

    peak = step_peak_bytes(engine.model, engine.device, engine.attention_backend, torch.float32, 16, 300, 8, peak_of)
    assert peak == 12345 and measured == [torch.device("cpu")]
    assert rows == [300] and sampled == [((8, engine.model.args.vocab_size), 8)]
    assert all(layer.self_attn.cache is None for layer in engine.model.model.layers)


def test_an_engine_logs_its_plan_at_start_up(tiny_model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="pipeline.engine.engine"):
        engine = Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), num_kv_blocks=64, block_size=16,
                                     max_model_len=512))
    args = engine.model.args
    per_block = KVCache.bytes_per_block(args.num_layers, args.num_kv_heads, args.head_dim, 16, engine.dtype)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:")]
    assert lines == [f"KV cache: 64 blocks of 16 tokens = 1,024 tokens ({64 * per_block / GIB:.2f} GiB), "
                     "2.0 sequences of max_model_len 512"]


def test_weights_that_do_not_fit_say_so_in_one_line(tmp_path, monkeypatch):
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.truncate(3 * GIB)   # sparse: its size without the disk
    with weights_must_fit(torch.device("cpu"), tmp_path):   # a CPU: nothing measured, nothing caught
        pass
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (GIB + GIB // 2, 80 * GIB))
    with pytest.raises(ValueError) as e, weights_must_fit(torch.device("cuda"), tmp_path):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate ...")
    message = str(e.value)
    assert "\n" not in message and message.startswith("the model does not fit on cuda")
    assert "its checkpoint is 3.00 GiB" in message and "1.50 of the device's 80.0 GiB were free" in message
