"""Small helpers of the engine tests: sampling settings, a run collected by id, checks."""
from __future__ import annotations

import random

from pipeline import Engine, Request, RequestOutput, SamplingParams


BIG_POOL = dict(num_kv_blocks=1024, block_size=16, max_num_batched_tokens=64, max_num_seqs=64)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def run(engine: Engine, requests: list[Request], **kw) -> dict[str, RequestOutput]:
    outputs = {}
    for out in engine.generate(requests, **kw):
        assert out.id not in outputs, f"{out.id} finished twice"
        outputs[out.id] = out
    return outputs


def check_output(out: RequestOutput, engine: Engine) -> None:
    """Fields every successful result must satisfy."""
    assert out.finish_reason in ("stop", "length")
    assert out.error is None
    assert out.output_tokens == len(out.token_ids) >= 1
    assert out.prompt_tokens >= 1
    assert all(0 <= t < engine.model.args.vocab_size for t in out.token_ids)
    assert 0.0 <= out.queue_s <= out.ttft_s <= out.latency_s


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 49000) for _ in range(n)]


def all_blocks_free(engine: Engine) -> bool:
    return (engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
            and engine.scheduler.num_unfinished == 0)


def sampled(seed, max_tokens=12, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed, ignore_eos=True, **kw)


def stop_after(checks: int):
    """A should_stop for generate() that turns true after `checks` checks (one per step)."""
    calls = 0

    def should_stop() -> bool:
        nonlocal calls
        calls += 1
        return calls > checks

    return should_stop
