"""n > 1 choices in the engine, on the tiny random Llama: the prompt is computed once and
its blocks (the partial last one included) shared; every choice is its own output."""
from __future__ import annotations

import random

import pytest

from pipeline import Engine, EngineConfig, Request, SamplingParams
from pipeline.engine.engine_loop import EngineLoop
from engine_helpers import BIG_POOL, all_blocks_free, greedy, random_prompt

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # see conftest


@pytest.fixture(scope="module", params=[True, False], ids=["prefix-caching", "no-prefix-caching"])
def engine(request, tiny_model_dir):
    return Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), enable_prefix_caching=request.param,
                               **BIG_POOL))


@pytest.fixture
def idle(engine):
    engine.reset_prefix_cache()
    yield engine
    assert all_blocks_free(engine)
    assert all(b.ref_count == 0 for b in engine.block_manager.blocks)


def by_choice(outputs) -> dict[tuple[str, int], object]:
    found = {}
    for out in outputs:
        assert (out.id, out.choice) not in found, f"{out.id} choice {out.choice} finished twice"
        found[out.id, out.choice] = out
    return found


def computed_tokens(engine: Engine, requests) -> tuple[dict, int]:
    """The outputs by (id, choice), and how many tokens the model computed for them."""
    counted = []
    run = engine.runner.run

    def counting(batch, *rest):
        counted.append(batch.num_tokens)
        return run(batch, *rest)
    engine.runner.run = counting
    try:
        outputs = by_choice(engine.generate(requests))
    finally:
        del engine.runner.run
    return outputs, sum(counted)


@pytest.mark.parametrize("prompt_len", [21, 32])   # a partial last block, and whole blocks only
def test_greedy_choices_equal_the_single_answer_and_the_prompt_is_computed_once(idle, prompt_len):
    prompt = random_prompt(random.Random(prompt_len), prompt_len)
    (single,) = idle.generate([Request("one", prompt_token_ids=prompt, params=greedy(6, ignore_eos=True))])
    idle.reset_prefix_cache()
    outputs, computed = computed_tokens(
        idle, [Request("four", prompt_token_ids=prompt, params=greedy(6, ignore_eos=True, n=4))])
    assert sorted(outputs) == [("four", c) for c in range(4)]
    for out in outputs.values():
        assert out.token_ids == single.token_ids
        assert out.prompt_tokens == prompt_len and out.output_tokens == 6
    # The prompt once, then each choice's own tokens (its last one is never fed back).
    assert computed == prompt_len + 4 * (6 - 1)
    assert outputs["four", 0].cached_tokens == 0
    assert all(outputs["four", c].cached_tokens == prompt_len for c in (1, 2, 3))


def test_seeded_choices_differ_and_each_is_reproducible_whatever_shares_the_batch(idle):
    rng = random.Random(3)
    prompt = random_prompt(rng, 19)
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=11, n=4)
    alone = by_choice(idle.generate([Request("s", prompt_token_ids=prompt, params=params)]))
    others = [Request(f"o{i}", prompt_token_ids=random_prompt(rng, rng.randint(3, 40)),
                      params=SamplingParams(temperature=1.0, max_tokens=rng.randint(2, 12), ignore_eos=True))
              for i in range(6)]
    crowded = by_choice(idle.generate([*others[:3], Request("s", prompt_token_ids=prompt, params=params),
                                       *others[3:]]))
    for c in range(4):
        assert crowded["s", c].token_ids == alone["s", c].token_ids
    assert len({tuple(alone["s", c].token_ids) for c in range(4)}) > 1   # independent draws
    n1 = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=11)
    (first,) = idle.generate([Request("s", prompt_token_ids=prompt, params=n1)])
    assert first.token_ids == alone["s", 0].token_ids   # choice 0 is the n = 1 answer


def test_choices_beyond_the_sequence_limit_wait_and_still_all_answer(tiny_model_dir):
    engine = Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), num_kv_blocks=40, block_size=4,
                                 max_num_batched_tokens=32, max_num_seqs=3))
    prompt = random_prompt(random.Random(5), 13)
    (single,) = engine.generate([Request("one", prompt_token_ids=prompt, params=greedy(10, ignore_eos=True))])
    outputs = by_choice(engine.generate([
        Request("many", prompt_token_ids=prompt, params=greedy(10, ignore_eos=True, n=7)),
        Request("other", prompt_token_ids=prompt[:5], params=greedy(4, ignore_eos=True, n=2))]))
    assert sorted(outputs) == [*(("many", c) for c in range(7)), ("other", 0), ("other", 1)]
    assert all(outputs["many", c].token_ids == single.token_ids for c in range(7))
    assert all_blocks_free(engine)


def test_a_request_that_cannot_run_and_one_that_times_out_unforked_answer_every_choice(idle):
    long_prompt = random_prompt(random.Random(9), 4 * BIG_POOL["max_num_batched_tokens"])   # 4 prefill steps
    outputs = by_choice(idle.generate([
        Request("empty", prompt_token_ids=[], params=greedy(4, n=3)),
        Request("bias", prompt_token_ids=[5, 6], params=greedy(4, n=2, logit_bias={10**7: 1})),
        Request("slow", prompt_token_ids=long_prompt, params=greedy(4, n=3), timeout_s=1e-9)]))
    assert sorted(outputs) == [("bias", 0), ("bias", 1), ("empty", 0), ("empty", 1), ("empty", 2),
                               ("slow", 0), ("slow", 1), ("slow", 2)]
    assert all(outputs[k].finish_reason == "error" for k in outputs if k[0] != "slow")
    assert all(outputs["slow", c].finish_reason == "timeout" and outputs["slow", c].output_tokens == 0
               for c in range(3))


def test_the_engine_loop_returns_every_choice_to_its_caller(tiny_model_dir):
    loop = EngineLoop(lambda: Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), **BIG_POOL)))
    try:
        outputs = by_choice(loop.generate([Request("a", prompt_token_ids=[5, 6, 7], params=greedy(3, n=3)),
                                           Request("b", prompt_token_ids=[8, 9], params=greedy(2))]))
        assert sorted(outputs) == [("a", 0), ("a", 1), ("a", 2), ("b", 0)]
    finally:
        loop.close()


def test_choices_share_an_int8_cache_too_scales_and_all(tiny_model_dir):
    engine = Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), kv_cache_dtype="int8", **BIG_POOL))
    prompt = random_prompt(random.Random(8), 23)
    (single,) = engine.generate([Request("one", prompt_token_ids=prompt, params=greedy(6, ignore_eos=True))])
    outputs = by_choice(engine.generate([Request("three", prompt_token_ids=prompt,
                                                 params=greedy(6, ignore_eos=True, n=3))]))
    assert [outputs["three", c].token_ids for c in range(3)] == [single.token_ids] * 3
