"""Fixtures of the engine tests (those the whole suite shares: tests/conftest.py)."""
from __future__ import annotations

import pytest
import torch

from pipeline import Engine, EngineConfig
from pipeline.engine import clock
from engine_helpers import BIG_POOL


@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dir):
    return Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), **BIG_POOL))


@pytest.fixture(scope="module")
def small_pool_engine(tiny_model_dir):
    """24 blocks of 4 tokens: 96 tokens of KV cache in all."""
    return Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), num_kv_blocks=24, block_size=4,
                               max_num_batched_tokens=64, max_num_seqs=64))


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, **kw) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=max_new_tokens, **kw)
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="session")
def hf_greedy():
    """hf_greedy(model, prompt_ids, max_new_tokens, **generate_kwargs): transformers' greedy tokens."""
    return _hf_greedy


class StoppedClock:
    """A clock that moves only when told to (`advance`)."""

    def __init__(self):
        self.seconds = 0.0

    def __call__(self) -> float:
        return self.seconds

    def advance(self, seconds: float) -> None:
        self.seconds += seconds


@pytest.fixture
def engine_clock(monkeypatch) -> StoppedClock:
    """The engines' clock (pipeline.engine.clock.now), stopped: a timeout is crossed when the
    test moves it past, on any machine, with nothing to wait for."""
    stopped = StoppedClock()
    monkeypatch.setattr(clock, "now", stopped)
    return stopped
