"""The INT8 KV cache on the tiny model: logits close to the float32 cache's (C and PyTorch
paths), and a budget that admits at least twice the sequences."""
from __future__ import annotations

import random

import pytest
import torch

from pipeline import Engine, EngineConfig, Request
from engine_helpers import BIG_POOL, all_blocks_free, greedy, random_prompt, run

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # see conftest

def recording_logits(engine: Engine, monkeypatch) -> list[torch.Tensor]:
    """Every step's logits, as the sampler receives them."""
    seen, sample = [], engine.sampler.__call__
    monkeypatch.setattr(engine.speculator, "sampler",   # what the engine's step samples with
                        lambda logits, seqs: (seen.append(logits.clone()), sample(logits, seqs))[1])
    return seen


def test_int8_kv_cache_logits_stay_close_to_the_auto_cache(tiny_engine, tiny_model_dir, monkeypatch):
    """One 100-token prompt in two chunks (the second reads the first from the cache), then
    decodes: every step's logits within a small bound of the float32 cache's, greedy tokens equal."""
    engine8 = Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), kv_cache_dtype="int8", **BIG_POOL))
    assert engine8.runner.kv_cache.k.dtype == torch.int8
    request = Request("q", prompt_token_ids=random_prompt(random.Random(3), 100), params=greedy(12, ignore_eos=True))
    ref_logits, got_logits = recording_logits(tiny_engine, monkeypatch), recording_logits(engine8, monkeypatch)
    ref, got = run(tiny_engine, [request])["q"], run(engine8, [request])["q"]
    assert got.token_ids == ref.token_ids
    assert len(got_logits) == len(ref_logits) == 12
    for a, b in zip(ref_logits, got_logits):
        err = (a - b).abs().max().item()
        assert 0 < err < 0.005 * a.abs().max().item(), err   # measured ~0.0008: lossy, but slightly
    assert all_blocks_free(engine8)
    # The PyTorch path (quantize in write_kv, dequantize per gathered block) agrees with the C one.
    from pipeline.kernels import cpu_kernels
    c_logits = list(got_logits)
    got_logits.clear()
    monkeypatch.setattr(cpu_kernels, "can_run_paged_decode_attention", lambda q, k_cache: False)
    monkeypatch.setattr(cpu_kernels, "can_write_kv", lambda qkv, k_cache: False)
    assert run(engine8, [request])["q"].token_ids == ref.token_ids
    for a, b in zip(c_logits, got_logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


def peak_running(engine: Engine, requests: list[Request]) -> int:
    for request in requests:
        assert engine.add_request(request) == []
    peak = 0
    while engine.has_unfinished_requests:
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    return peak


def test_int8_kv_budget_admits_at_least_twice_the_sequences(tiny_model_dir):
    """The same kv_cache_gib: eight float32 blocks hold 4 of these 2-block sequences at once;
    int8 (a quarter of the bytes plus a float32 scale per token and head) more than twice as many."""
    rng = random.Random(5)
    requests = [Request(f"r{i}", prompt_token_ids=random_prompt(rng, 20), params=greedy(4, ignore_eos=True))
                for i in range(16)]
    budget = dict(device="cpu", model=str(tiny_model_dir), block_size=16, max_num_seqs=64,
                  kv_cache_gib=8 * 2 * 2 * 16 * 2 * 16 * 4 / 2**30)   # 8 float32 blocks of the tiny model
    auto = Engine(EngineConfig(**budget))
    int8 = Engine(EngineConfig(**budget, kv_cache_dtype="int8"))
    assert auto.block_manager.num_blocks == 8
    assert int8.block_manager.num_blocks >= 2 * auto.block_manager.num_blocks
    assert peak_running(auto, requests) == 4
    assert peak_running(int8, requests) >= 8
    assert int8.block_manager.peak_utilization > 0.6
