"""The KV-cache budget and the batch size per device (pipeline/engine/memory_budget.py): a CPU
keeps the budget it is given; on CUDA the cache takes what the utilisation share leaves."""
from __future__ import annotations

import pytest
import torch

from pipeline.config import EngineConfig
from pipeline.engine.memory_budget import (
    activation_reserve_bytes, budget_from_free_memory, kv_cache_bytes, max_num_batched_tokens, max_num_seqs,
)
from pipeline.models.llama import LlamaArgs

GIB = 2**30
ARGS = LlamaArgs.from_hf_config({   # the bundled model's shape
    "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192})


def test_a_cpu_keeps_its_budget_and_batch():
    cpu = torch.device("cpu")
    assert kv_cache_bytes(EngineConfig(), cpu, ARGS, torch.float32, 64) == GIB
    assert kv_cache_bytes(EngineConfig(kv_cache_gib=0.25), cpu, ARGS, torch.float32, 64) == GIB // 4
    assert max_num_seqs(EngineConfig(), cpu) == 64 and max_num_seqs(EngineConfig(max_num_seqs=8), cpu) == 8
    assert max_num_seqs(EngineConfig(), torch.device("cuda")) == 256   # sized for the device


def test_a_step_takes_more_tokens_on_cuda():
    assert max_num_batched_tokens(EngineConfig(), torch.device("cpu")) == 1024
    assert max_num_batched_tokens(EngineConfig(), torch.device("cuda")) == 8192
    assert max_num_batched_tokens(EngineConfig(max_num_batched_tokens=64), torch.device("cuda")) == 64


def test_on_cuda_the_cache_is_measured_after_the_allocator_gives_back_what_loading_freed(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: calls.append("mem_get_info") or
                        (70 * GIB, 80 * GIB))
    budget = kv_cache_bytes(EngineConfig(), torch.device("cuda"), ARGS, torch.bfloat16, 256)
    assert calls == ["synchronize", "empty_cache", "mem_get_info"]
    assert budget == int(80 * GIB * 0.9) - 10 * GIB - activation_reserve_bytes(ARGS, 8192, 256, 2)
    # A backend that copies a layer's keys and values out each step (varlen_packed) leaves
    # room for one layer's share of the cache; a budget given in GiB is kept as it is.
    copying = kv_cache_bytes(EngineConfig(), torch.device("cuda"), ARGS, torch.bfloat16, 256, copies_layer_kv=True)
    assert copying == budget * 30 // 31 and budget - copying >= copying // 30
    assert kv_cache_bytes(EngineConfig(kv_cache_gib=2), torch.device("cuda"), ARGS, torch.bfloat16, 256,
                          copies_layer_kv=True) == 2 * GIB


def test_on_cuda_the_cache_takes_what_the_share_leaves_after_loading():
    total, used = 80 * GIB, 3 * GIB   # weights and context already on the device
    reserve = activation_reserve_bytes(ARGS, 1024, 256, 2)
    assert 0 < reserve < GIB   # one step of the bundled model's shape is small beside the cache
    budget = budget_from_free_memory(total - used, total, 0.9, reserve)
    assert budget == int(total * 0.9) - used - reserve
    # another process holding memory leaves the cache less, never an overcommitted device
    assert budget_from_free_memory(total - used - 10 * GIB, total, 0.9, reserve) == budget - 10 * GIB
    with pytest.raises(ValueError, match="no GPU memory left for the KV cache"):
        budget_from_free_memory(int(total * 0.05), total, 0.9, reserve)


def test_the_options_are_checked():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="kv_cache_gib"):
        EngineConfig(kv_cache_gib=0)
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)
