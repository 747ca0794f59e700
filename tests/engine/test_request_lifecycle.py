"""A request's life in the engine: what a result holds, requests that cannot run failing
alone, a timeout, generation stopped or abandoned, and requests pulled lazily."""
from __future__ import annotations

import random

import pytest

from pipeline import Engine, EngineConfig, Request
from engine_helpers import all_blocks_free, check_output, greedy, random_prompt, run, stop_after
from cluster import TINY_CONTEXT, TOO_LONG_FOR_TINY

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # see conftest

PROMPT = [504, 2365, 6354, 1604, 3987, 46477, 6403, 1980]

def test_request_output_fields(tiny_engine):
    outs = run(tiny_engine, [Request("a", prompt="Hello there", params=greedy(6, ignore_eos=True)),
                             Request("b", prompt_token_ids=PROMPT, params=greedy(3, ignore_eos=True))])
    assert outs["a"].prompt_tokens == len(tiny_engine.tokenizer.encode("Hello there"))
    assert outs["b"].prompt_tokens == len(PROMPT)
    assert outs["a"].output_tokens == 6 and outs["b"].output_tokens == 3
    for out in outs.values():
        check_output(out, tiny_engine)
        assert out.text == tiny_engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_a_request_past_its_timeout_ends_with_its_partial_text_and_frees_its_blocks(tiny_engine, engine_clock):
    """timeout_s counts from the request's first step: the prefill step always runs (and
    samples one token), so a timed-out request keeps at least that; the others run on. The
    engine's clock moves only when the test moves it: a step short of the timeout decodes
    one more token, the first step at it retires the request."""
    timed = Request("timed", prompt_token_ids=[5, 6, 7], params=greedy(400, ignore_eos=True), timeout_s=0.5)
    others = [Request(f"o{i}", prompt_token_ids=[8 + i, 9], params=greedy(6, ignore_eos=True)) for i in range(3)]
    assert all(tiny_engine.add_request(request) == [] for request in [timed, *others])
    outs = {out.id: out for out in tiny_engine.step()}   # the prefill, at 0 s
    engine_clock.advance(0.25)
    assert tiny_engine.step() == []   # short of the timeout: one more token each
    engine_clock.advance(0.25)
    while tiny_engine.has_unfinished_requests:
        outs.update((out.id, out) for out in tiny_engine.step())
    out = outs["timed"]
    assert out.finish_reason == "timeout" and out.error == "timed out after 0.5 s"
    assert out.output_tokens == 2 == len(out.token_ids)   # the prefill step's token, one more, then the timeout
    assert out.text == tiny_engine.tokenizer.decode(out.token_ids) and out.latency_s == 0.5
    for rid in ("o0", "o1", "o2"):
        check_output(outs[rid], tiny_engine)
        assert outs[rid].output_tokens == 6
    assert all_blocks_free(tiny_engine)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        Request("bad", prompt="x", timeout_s=0)


def test_prompts_that_cannot_fit_fail_alone(tiny_engine, small_pool_engine):
    rng = random.Random(4)
    outs = run(small_pool_engine, [
        Request("ok1", prompt_token_ids=random_prompt(rng, 10), params=greedy(5)),
        Request("cache", prompt_token_ids=random_prompt(rng, 100), params=greedy(5)),   # > 96-token cache
        Request("empty", prompt_token_ids=[], params=greedy(5)),
        Request("ok2", prompt_token_ids=random_prompt(rng, 20), params=greedy(5))])
    assert outs["cache"].finish_reason == "error"
    assert "100 prompt tokens" in outs["cache"].error and "the whole cache holds 96" in outs["cache"].error
    assert outs["empty"].finish_reason == "error" and "empty" in outs["empty"].error
    for rid in ("cache", "empty"):
        assert outs[rid].token_ids == [] and outs[rid].text == "" and outs[rid].ttft_s is None
    assert outs["cache"].prompt_tokens == 100
    for rid in ("ok1", "ok2"):
        check_output(outs[rid], small_pool_engine)
    assert all_blocks_free(small_pool_engine)

    outs = run(tiny_engine, [Request("long", prompt=TOO_LONG_FOR_TINY, params=greedy(5)),
                             Request("ok", prompt="hello", params=greedy(5))])
    assert outs["long"].finish_reason == "error"
    assert f"maximum model length is {TINY_CONTEXT}" in outs["long"].error
    check_output(outs["ok"], tiny_engine)


def test_should_stop_ends_generation_and_frees_blocks(tiny_engine):
    rng = random.Random(5)
    requests = [Request(f"x{i}", prompt_token_ids=random_prompt(rng, 20 + i), params=greedy(200, ignore_eos=True))
                for i in range(6)]
    steps_before = tiny_engine.num_steps
    outs = run(tiny_engine, requests, should_stop=stop_after(5))
    assert outs == {}                                      # nothing could finish in 5 steps
    assert tiny_engine.num_steps - steps_before == 5
    assert all_blocks_free(tiny_engine)
    # The engine is still usable afterwards.
    again = run(tiny_engine, [Request("after", prompt_token_ids=PROMPT, params=greedy(3, ignore_eos=True))])
    assert again["after"].output_tokens == 3


def test_abandoned_generate_leaves_nothing_behind(tiny_engine):
    stream = tiny_engine.generate([Request("short", prompt_token_ids=PROMPT, params=greedy(1)),
                                   Request("long", prompt_token_ids=PROMPT, params=greedy(30, ignore_eos=True))])
    assert next(stream).id == "short"
    stream.close()                                         # the caller stops early
    assert all_blocks_free(tiny_engine)
    outs = run(tiny_engine, [Request("next", prompt_token_ids=PROMPT, params=greedy(2))])
    assert set(outs) == {"next"}                           # "long" does not resurface


def test_requests_are_pulled_lazily(tiny_model_dir):
    engine = Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), num_kv_blocks=64, max_num_seqs=2))
    pulled = 0

    def requests():
        nonlocal pulled
        for i in range(20):
            pulled += 1
            yield Request(f"l{i}", prompt_token_ids=PROMPT[: 2 + i % 6], params=greedy(2, ignore_eos=True))

    stream = engine.generate(requests())
    next(stream)
    assert pulled < 20
    assert len(list(stream)) == 19
    assert pulled == 20 and all_blocks_free(engine)
