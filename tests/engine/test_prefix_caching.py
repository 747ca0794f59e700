"""Prefix caching in the engine, on real weights: the same tokens with and without it,
exact cached-token counts, and every reference released however a request ends."""
from __future__ import annotations

import random

import pytest

from pipeline import Engine, EngineConfig, Request
from engine_helpers import BIG_POOL, all_blocks_free, check_output, greedy, random_prompt, run, sampled, stop_after

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # see conftest

BLOCK = BIG_POOL["block_size"]


@pytest.fixture(scope="module")
def cached_engine(tiny_model_dir):
    return Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), enable_prefix_caching=True, **BIG_POOL))


@pytest.fixture(scope="module")
def plain_engine(tiny_model_dir):
    return Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), enable_prefix_caching=False, **BIG_POOL))


@pytest.fixture
def cold(cached_engine):
    """The cached engine with an empty prefix cache, checked to be idle again afterwards."""
    assert cached_engine.reset_prefix_cache()
    yield cached_engine
    assert all_blocks_free(cached_engine)
    assert all(b.ref_count == 0 for b in cached_engine.block_manager.blocks)


def shared_prefix_requests(n: int, prefix_len: int, seed: int, params=None) -> list[Request]:
    rng = random.Random(seed)
    prefix = random_prompt(rng, prefix_len)
    return [Request(f"r{i}", prompt_token_ids=prefix + random_prompt(rng, rng.randint(1, 40)),
                    params=params(i) if params else greedy(rng.randint(4, 16), ignore_eos=True))
            for i in range(n)]


def test_defaults_on_and_can_be_turned_off(cached_engine, plain_engine):
    assert EngineConfig().enable_prefix_caching is True
    assert cached_engine.block_manager.enable_prefix_caching
    assert not plain_engine.block_manager.enable_prefix_caching


def test_second_request_gets_exactly_the_shared_full_blocks(cold, plain_engine):
    prefix = random_prompt(random.Random(3), 3 * BLOCK + 5)          # 3 full blocks + 5 tokens
    first = Request("first", prompt_token_ids=prefix + [11, 12], params=greedy(6, ignore_eos=True))
    second = Request("second", prompt_token_ids=prefix + [13, 14, 15], params=greedy(6, ignore_eos=True))
    assert run(cold, [first])["first"].cached_tokens == 0
    out = run(cold, [second])["second"]
    assert out.cached_tokens == 3 * BLOCK
    check_output(out, cold)
    assert out.token_ids == run(plain_engine, [second])["second"].token_ids
    assert run(plain_engine, [second])["second"].cached_tokens == 0


def test_a_prompt_of_whole_blocks_still_computes_its_last_token(cold):
    prompt = random_prompt(random.Random(4), 2 * BLOCK)
    run(cold, [Request("a", prompt_token_ids=prompt, params=greedy(3, ignore_eos=True))])
    out = run(cold, [Request("b", prompt_token_ids=prompt, params=greedy(3, ignore_eos=True))])["b"]
    assert out.cached_tokens == BLOCK                  # not 2 blocks: the last token needs its logits


def test_batch_of_32_with_a_shared_prefix_matches_no_caching(cold, plain_engine):
    requests = shared_prefix_requests(32, prefix_len=70, seed=5)
    expected = run(plain_engine, requests)
    got = run(cold, requests)
    assert set(got) == set(expected)
    for rid, out in got.items():
        check_output(out, cold)
        assert out.token_ids == expected[rid].token_ids, rid
    # Arriving together, they computed the prefix once: all but the first found its
    # 4 full blocks (64 of the 70 tokens) in the cache.
    assert sorted(o.cached_tokens for o in got.values()) == [0] + [4 * BLOCK] * 31
    # Alone, afterwards, each request hits the cache and still gives the same tokens.
    for request in requests[:4]:
        alone = run(cold, [request])[request.id]
        assert alone.cached_tokens >= 4 * BLOCK
        assert alone.token_ids == expected[request.id].token_ids


def test_seeded_sampling_is_the_same_with_and_without_caching(cold, plain_engine):
    """The same seeds draw the same tokens. The random model's distribution is nearly flat over
    49,152 tokens, so top_k keeps the draw off a knife's edge: with caching the prompt is
    computed in other batch shapes, and where the GEMM's blocking follows the shape (oneDNN
    on AMX) logits move in their last bits, which moved a top_p-only draw to the next token id."""
    requests = shared_prefix_requests(8, prefix_len=40, seed=6,
                                      params=lambda i: sampled(100 + i, max_tokens=10, top_k=8, top_p=0.9))
    expected = run(plain_engine, requests)
    got = run(cold, requests)
    assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in expected.items()}
    assert sum(o.cached_tokens for o in got.values()) == 7 * 2 * BLOCK


def test_tiny_pool_evicts_and_preempts_and_still_matches(tiny_model_dir, plain_engine):
    """24 blocks of 4 tokens: cached blocks get evicted, sequences preempted (and hit
    their own blocks again when recomputed), and the tokens stay those of the big pool."""
    engine = Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), num_kv_blocks=24, block_size=4,
                                 max_num_batched_tokens=64, max_num_seqs=64, enable_prefix_caching=True))
    rng = random.Random(7)
    prefixes = [random_prompt(rng, n) for n in (9, 17, 30)]
    requests = [Request(f"p{i}", prompt_token_ids=rng.choice(prefixes) + random_prompt(rng, rng.randint(1, 12)),
                        params=greedy(rng.randint(8, 24), ignore_eos=True)) for i in range(16)]
    expected = run(plain_engine, requests)
    got = run(engine, requests)
    bm = engine.block_manager
    assert engine.scheduler.num_preemptions > 0
    assert sum(o.cached_tokens for o in got.values()) > 0
    for rid, out in got.items():
        assert out.token_ids == expected[rid].token_ids, rid
    assert all_blocks_free(engine) and all(b.ref_count == 0 for b in bm.blocks)
    # Something was evicted: the pool cannot hold every full block these requests made.
    made = sum((o.prompt_tokens + o.output_tokens) // 4 for o in got.values())
    assert bm.num_cached_blocks < made


def test_stop_strings_and_aborts_release_every_reference(cold):
    requests = shared_prefix_requests(6, prefix_len=36, seed=8,
                                      params=lambda i: greedy(200, ignore_eos=True))
    reference = run(cold, [Request("ref", prompt_token_ids=requests[0].prompt_token_ids,
                                   params=greedy(12, ignore_eos=True))])["ref"]
    stop = next(reference.text[i:i + 2] for i in range(2, len(reference.text) - 2)
                if reference.text[i:i + 2].strip() and "\ufffd" not in reference.text[i:i + 2])
    out = run(cold, [Request("stop", prompt_token_ids=requests[0].prompt_token_ids,
                             params=greedy(12, stop=[stop]))])["stop"]
    assert out.finish_reason == "stop"
    assert out.cached_tokens == (len(requests[0].prompt_token_ids) - 1) // BLOCK * BLOCK
    # Abort mid-way: every sequence sharing the prefix lets go of it.
    assert run(cold, requests, should_stop=stop_after(3)) == {}
    assert cold.block_manager.num_cached_blocks >= 2


def test_a_failed_step_forgets_the_cache(cold, monkeypatch):
    """Blocks are findable from the step that computes them; if that step fails, their
    content was never written, so the engine must not serve them afterwards."""
    request = shared_prefix_requests(1, prefix_len=40, seed=9)[0]

    def broken_run(batch, *rest):
        raise RuntimeError("device lost")

    monkeypatch.setattr(cold.runner, "run", broken_run)
    with pytest.raises(RuntimeError, match="device lost"):
        run(cold, [request])
    monkeypatch.undo()
    assert cold.block_manager.num_cached_blocks == 0
    assert run(cold, [request])[request.id].cached_tokens == 0
