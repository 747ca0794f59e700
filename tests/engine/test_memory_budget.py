"""The KV-cache budget and the batch size per device (pipeline/engine/memory_budget.py): a CPU
keeps the budget it is given; the CUDA plan's arithmetic and its profiling step are in
test_memory_plan.py."""
from __future__ import annotations

import pytest
import torch

from pipeline.config import EngineConfig
from pipeline.engine.memory_budget import kv_cache_bytes, kv_cache_plan, max_num_batched_tokens, max_num_seqs
from pipeline.models.llama import LlamaArgs

GIB = 2**30
ARGS = LlamaArgs.from_hf_config({   # the bundled model's shape
    "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192})


def test_a_cpu_keeps_its_budget_and_batch():
    cpu = torch.device("cpu")
    assert kv_cache_bytes(EngineConfig()) == GIB
    assert kv_cache_bytes(EngineConfig(kv_cache_gib=0.25)) == GIB // 4
    assert max_num_seqs(EngineConfig(), cpu) == 64 and max_num_seqs(EngineConfig(max_num_seqs=8), cpu) == 8
    assert max_num_seqs(EngineConfig(), torch.device("cuda")) == 256   # sized for the device


def test_a_cpu_plan_is_the_budget_over_the_block_size_and_measures_nothing():
    plan = kv_cache_plan(EngineConfig(), torch.device("cpu"), ARGS, torch.float32, 64)
    per_block = 2 * 30 * 16 * 3 * 64 * 4   # k and v, 30 layers, 16 tokens, 3 KV heads of 64, float32
    assert (plan.block_size, plan.bytes_per_block, plan.num_blocks, plan.gpu) == (16, per_block, GIB // per_block, None)
    assert kv_cache_plan(EngineConfig(num_kv_blocks=7), torch.device("cpu"), ARGS, torch.float32, 64).num_blocks == 7


def test_a_step_takes_more_tokens_on_cuda():
    assert max_num_batched_tokens(EngineConfig(), torch.device("cpu")) == 1024
    assert max_num_batched_tokens(EngineConfig(), torch.device("cuda")) == 8192
    assert max_num_batched_tokens(EngineConfig(max_num_batched_tokens=64), torch.device("cuda")) == 64


def test_the_options_are_checked():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="kv_cache_gib"):
        EngineConfig(kv_cache_gib=0)
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)
