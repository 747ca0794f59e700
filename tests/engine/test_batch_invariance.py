"""Batch-invariant inference (pipeline/layers/batch_invariant.py): a greedy or seeded
request gets the same token ids and logprobs, bit for bit, alone or inside a batch of 255
others, with prefill chunks of 7, 64 or 1,024 tokens, with its 512-token prefix from the
prefix cache, and as choice 0 of n = 4; a greedy one's tokens also with n-gram
speculation (which drafts nothing for a request with logprobs). In float32 and, where
the CPU computes it natively, bfloat16; the tiny random Llama and the bundled model."""
from __future__ import annotations

import random

import pytest

from pipeline import Engine, EngineConfig, Request, SamplingParams
from pipeline.device import cpu_has_native_bf16

NATIVE_BF16 = pytest.mark.skipif(not cpu_has_native_bf16(), reason="this CPU has no AVX-512 BF16 or AMX: bfloat16 "
                                                                  "is emulated here and auto never chooses it")
DTYPES = ["float32", pytest.param("bfloat16", marks=NATIVE_BF16)]
PREFIX = 512


def targets(rng: random.Random, count: int) -> list[list[int]]:
    """Prompts sharing a 512-token prefix; each ends in a phrase said three times, so that
    n-gram speculation has something to draft."""
    prefix = [rng.randrange(100, 49000) for _ in range(PREFIX)]
    prompts = []
    for _ in range(count):
        phrase = [rng.randrange(100, 49000) for _ in range(rng.randrange(3, 9))]
        prompts.append(prefix + [rng.randrange(100, 49000) for _ in range(rng.randrange(1, 30))] + phrase * 3)
    return prompts


def params(i: int, max_tokens: int, n: int = 1) -> SamplingParams:
    """Even targets greedy, odd ones sampled with a seed of their own; logprobs with 3 alternatives."""
    if i % 2:
        return SamplingParams(temperature=0.9, top_p=0.95, seed=1000 + i, max_tokens=max_tokens, logprobs=3,
                              ignore_eos=True, n=n)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=3, ignore_eos=True, n=n)


def others(rng: random.Random, count: int) -> list[Request]:
    """Random neighbours: lengths 1-200, 1-30 tokens out, greedy or sampled without a seed."""
    return [Request(f"other{j}", prompt_token_ids=[rng.randrange(100, 49000) for _ in range(rng.randrange(1, 200))],
                    params=SamplingParams(temperature=rng.choice([0.0, 1.0]), max_tokens=rng.randrange(1, 30),
                                          ignore_eos=True))
            for j in range(count)]


def answers(outputs) -> dict[int, tuple]:
    """Each target's (token ids, logprobs, alternatives) of choice 0, by its number."""
    found = {}
    for out in outputs:
        if out.id.startswith("t") and out.choice == 0:
            assert out.error is None, out.error
            found[int(out.id[1:])] = (out.token_ids, [(lp.logprob, [(a.token_id, a.logprob) for a in lp.top])
                                                      for lp in out.logprobs])
    return found


def check_invariance(model_dir, dtype: str, count: int, max_tokens: int, num_others: int, chunks: tuple[int, ...]):
    rng = random.Random(7)
    prompts = targets(rng, count)

    def engine(**options) -> Engine:
        config = dict(device="cpu", model=str(model_dir), dtype=dtype, num_kv_blocks=2048, block_size=16,
                      max_num_seqs=256, max_num_batched_tokens=1024, enable_prefix_caching=False)
        return Engine(EngineConfig(**{**config, **options}))

    def requests(n: int = 1) -> list[Request]:
        return [Request(f"t{i}", prompt_token_ids=p, params=params(i, max_tokens, n)) for i, p in enumerate(prompts)]

    plain = engine()
    alone = {}
    for request in requests():
        alone.update(answers(plain.generate([request])))
    assert sorted(alone) == list(range(count))
    crowd = others(rng, num_others)
    mixed = crowd[:num_others // 2] + requests() + crowd[num_others // 2:]
    assert answers(plain.generate(mixed)) == alone, "inside a batch of others"
    assert answers(plain.generate(requests(n=4))) == alone, "as choice 0 of n = 4"
    del plain
    for chunk in chunks:
        assert answers(engine(max_num_batched_tokens=chunk).generate(requests())) == alone, f"chunks of {chunk}"
    cached = engine(enable_prefix_caching=True)
    [_] = cached.generate([Request("warm", prompt_token_ids=prompts[0][:PREFIX] + [5], params=params(0, 1))])
    outputs = [*cached.generate(requests())]
    assert min(out.cached_tokens for out in outputs) >= PREFIX
    assert answers(outputs) == alone, "with the prefix from the prefix cache"
    del cached
    # Drafts are verified for greedy requests without logprobs (speculative.py): their tokens.
    greedy = [Request(f"t{i}", prompt_token_ids=p, params=SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                          ignore_eos=True))
              for i, p in enumerate(prompts) if i % 2 == 0]
    outputs = [*engine(speculative="ngram").generate(greedy)]
    assert sum(out.draft_tokens for out in outputs) > 0   # speculation did draft
    assert {int(out.id[1:]): out.token_ids for out in outputs} == {
        i: alone[i][0] for i in range(0, count, 2)}, "with n-gram speculation"


@pytest.mark.parametrize("dtype", DTYPES)
def test_tiny_model_answers_do_not_depend_on_the_batch(tiny_model_dir, dtype):
    check_invariance(tiny_model_dir, dtype, count=32, max_tokens=12, num_others=255, chunks=(7, 64, 1024))


@pytest.mark.parametrize("dtype", DTYPES)
def test_bundled_model_answers_do_not_depend_on_the_batch(bundled_model_dir, dtype):
    check_invariance(bundled_model_dir, dtype, count=6, max_tokens=8, num_others=63, chunks=(64,))
