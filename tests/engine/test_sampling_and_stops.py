"""Sampling and stopping on the tiny model: seeded draws, top-k, the repetition penalty
against Hugging Face; stop strings, stop tokens, max_tokens and the model's context length."""
from __future__ import annotations

import random

import pytest

from pipeline import Request
from engine_helpers import greedy, random_prompt, run, sampled
from cluster import TINY_CONTEXT

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # see conftest

PROMPT = [504, 2365, 6354, 1604, 3987, 46477, 6403, 1980]

def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_engine):
    alone = run(tiny_engine, [Request("a", prompt_token_ids=PROMPT, params=sampled(7))])["a"]
    again = run(tiny_engine, [Request("a", prompt_token_ids=PROMPT, params=sampled(7))])["a"]
    assert alone.token_ids == again.token_ids
    rng = random.Random(2)
    batch = [Request("a", prompt_token_ids=PROMPT, params=sampled(7)),
             Request("b", prompt_token_ids=PROMPT, params=sampled(8)),
             Request("c", prompt_token_ids=random_prompt(rng, 30), params=sampled(9, top_p=0.9)),
             Request("d", prompt_token_ids=random_prompt(rng, 70), params=sampled(None)),
             Request("e", prompt_token_ids=random_prompt(rng, 5), params=greedy(12))]
    outs = run(tiny_engine, batch)
    assert outs["a"].token_ids == alone.token_ids
    assert outs["b"].token_ids != alone.token_ids          # another seed, another draw
    assert len(alone.token_ids) == 12


def test_top_k_1_equals_greedy(tiny_engine):
    outs = run(tiny_engine, [Request("g", prompt_token_ids=PROMPT, params=greedy(12, ignore_eos=True)),
                             Request("k", prompt_token_ids=PROMPT, params=sampled(3, top_k=1))])
    assert outs["k"].token_ids == outs["g"].token_ids


def test_repetition_penalty_matches_hugging_face(tiny_engine, hf_tiny, hf_greedy):
    prompt = tiny_engine.tokenizer.encode(" ".join(f"word{j}" for j in range(7)) + " hello")
    plain = run(tiny_engine, [Request("p", prompt_token_ids=prompt, params=greedy(16, ignore_eos=True))])["p"]
    assert len(set(plain.token_ids)) < len(plain.token_ids)      # greedy falls into a loop
    out = run(tiny_engine, [Request("rp", prompt_token_ids=prompt,
                                    params=greedy(16, ignore_eos=True, repetition_penalty=1.5))])["rp"]
    assert out.token_ids != plain.token_ids
    assert out.token_ids == hf_greedy(hf_tiny, prompt, 16, min_new_tokens=16, eos_token_id=None,
                                      repetition_penalty=1.5)


@pytest.fixture(scope="module")
def greedy_reference(tiny_engine):
    """A 24-token greedy run of PROMPT, to derive stop conditions that are sure to occur."""
    return run(tiny_engine, [Request("ref", prompt_token_ids=PROMPT, params=greedy(24, ignore_eos=True))])["ref"]


def test_stop_string_cuts_text_exactly(tiny_engine, greedy_reference):
    text = greedy_reference.text
    # A 3-character stop string from the middle of the reference text (no U+FFFD in it).
    pos = next(i for i in range(len(text) // 3, len(text) - 3) if "\ufffd" not in text[i:i + 3]
               and text[i:i + 3].strip())
    stop = text[pos:pos + 3]
    cut = text.find(stop)
    assert cut > 0
    out = run(tiny_engine, [Request("s", prompt_token_ids=PROMPT, params=greedy(24, stop=[stop]))])["s"]
    assert out.finish_reason == "stop"
    assert out.text == text[:cut]
    assert stop not in out.text
    assert out.token_ids == greedy_reference.token_ids[:len(out.token_ids)]
    assert len(out.token_ids) < 24


def test_stop_token_ids(tiny_engine, greedy_reference):
    ref = greedy_reference.token_ids
    i = next(i for i in range(4, len(ref)) if ref.index(ref[i]) == i)
    out = run(tiny_engine, [Request("t", prompt_token_ids=PROMPT,
                                    params=greedy(24, stop_token_ids=[ref[i]]))])["t"]
    assert out.finish_reason == "stop"
    assert out.token_ids == ref[:i + 1]


def test_max_tokens_gives_length(tiny_engine, greedy_reference):
    outs = run(tiny_engine, [Request(f"m{n}", prompt_token_ids=PROMPT, params=greedy(n, ignore_eos=True))
                             for n in (1, 2, 7)])
    for n in (1, 2, 7):
        assert outs[f"m{n}"].finish_reason == "length"
        assert outs[f"m{n}"].token_ids == greedy_reference.token_ids[:n]


def test_generation_stops_at_max_model_len(tiny_engine):
    assert tiny_engine.max_model_len == TINY_CONTEXT
    out = run(tiny_engine, [Request("edge", prompt_token_ids=random_prompt(random.Random(3), TINY_CONTEXT - 3),
                                    params=greedy(50, ignore_eos=True))])["edge"]
    assert out.finish_reason == "length"
    assert out.output_tokens == 3                              # (context - 3) + 3 == context
