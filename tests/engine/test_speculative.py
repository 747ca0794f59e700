"""Speculative decoding (pipeline/engine/speculative.py): n-gram drafts verified in one pass.

Greedy output must be identical to plain decoding, alone and in a batch; the KV cache's
blocks exactly accounted for after rejections; stop strings and max_tokens cut inside an
accepted draft exactly; sampled output drawn from the same distribution.
"""
from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline import Engine, EngineConfig, Request, SamplingParams
from pipeline.layers.sampler import Sampler
from pipeline.engine.sequence import Sequence
from pipeline.engine.speculative import NgramProposer, Speculator


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()   # see tests/conftest.py: predictable on a shared machine
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


POOL = dict(device="cpu", num_kv_blocks=512, block_size=16, max_num_batched_tokens=64, max_num_seqs=64)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run(engine: Engine, requests: list[Request]) -> dict:
    return {o.id: o for o in engine.generate(requests)}


def repetitive_prompt(rng: random.Random, n: int) -> list[int]:
    """Random tokens with a repeated stretch: something for prompt lookup to find."""
    pattern = [rng.randrange(100, 49000) for _ in range(rng.randint(3, 12))]
    tokens = [rng.randrange(100, 49000) for _ in range(rng.randint(0, 20))]
    while len(tokens) < n:
        tokens += pattern
    return tokens[:n]


def test_ngram_proposer_takes_the_latest_longest_match():
    p = NgramProposer()
    assert p.propose(np.array([1, 2, 3, 4, 1, 2]), 3) == [3, 4, 1]
    assert p.propose(np.array([5, 1, 2, 9, 7, 1, 2, 8, 3, 1, 2]), 2) == [8, 3]     # the latest match
    assert p.propose(np.array([1, 2, 9, 5, 2, 8, 1, 2]), 2) == [9, 5]              # (1, 2) before the later (2,)
    assert p.propose(np.array([1, 2, 3, 4]), 3) == []
    assert p.propose(np.array([7]), 3) == []
    assert p.propose(np.array([1, 2, 3, 1, 2, 3]), 5) == [1, 2, 3]                 # only what follows


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    plain = Engine(EngineConfig(model=str(tiny_model_dir), **POOL))
    spec = Engine(EngineConfig(model=str(tiny_model_dir), speculative="ngram", num_speculative_tokens=4, **POOL))
    return plain, spec


@pytest.fixture(scope="module")
def batch32(engines):
    rng = random.Random(0)
    requests = [Request(f"r{i}", prompt_token_ids=repetitive_prompt(rng, rng.randint(5, 150)),
                        params=greedy(rng.randint(6, 24))) for i in range(32)]
    plain, spec = engines
    return requests, run(plain, requests), run(spec, requests)


def test_greedy_tokens_are_identical_in_a_batch_of_32(engines, batch32):
    requests, reference, got = batch32
    assert {k: o.token_ids for k, o in got.items()} == {k: o.token_ids for k, o in reference.items()}
    drafted = sum(o.draft_tokens for o in got.values())
    accepted = sum(o.accepted_tokens for o in got.values())
    assert 0 < accepted < drafted          # drafts were both accepted and rejected
    assert all(o.draft_tokens == o.accepted_tokens == 0 for o in reference.values())
    assert engines[1].block_manager.num_free_blocks == engines[1].block_manager.num_blocks


@pytest.mark.parametrize("rid", ["r0", "r5", "r17"])
def test_greedy_tokens_alone_equal_the_batch(engines, batch32, rid):
    requests, reference, _ = batch32
    alone = run(engines[1], [r for r in requests if r.id == rid])[rid]
    assert alone.token_ids == reference[rid].token_ids


def test_block_accounting_is_exact_after_rejections(engines):
    """After every step each running sequence holds exactly the blocks of its computed
    tokens (rejected drafts' slots given back), and free + held = the pool."""
    _, spec = engines
    bm = spec.block_manager
    rng = random.Random(1)
    for i in range(12):
        spec.add_request(Request(f"b{i}", prompt_token_ids=repetitive_prompt(rng, rng.randint(10, 90)),
                                 params=greedy(rng.randint(10, 30))))
    rejected_steps = 0
    while spec.has_unfinished_requests:
        before = {s.request_id: (s.num_draft_tokens, s.num_accepted_tokens) for s in spec.scheduler.running}
        spec.step()
        held = set()
        for seq in spec.scheduler.running:
            assert len(seq.block_table) == bm.blocks_needed(seq.num_computed_tokens), seq.request_id
            assert seq.num_computed_tokens == seq.num_tokens - 1 or seq.num_computed_tokens < seq.num_prompt_tokens
            assert not seq.draft_token_ids
            held.update(seq.block_table)
            drafted, accepted = before.get(seq.request_id, (0, 0))
            rejected_steps += (seq.num_draft_tokens - drafted) > (seq.num_accepted_tokens - accepted)
        assert bm.num_free_blocks + len(held) == bm.num_blocks
    assert rejected_steps > 0
    assert bm.num_free_blocks == bm.num_blocks


def test_max_tokens_and_stop_strings_cut_inside_an_accepted_draft(engines):
    """Drafts never reach past max_tokens (the last new token is always a verified one), so
    a run can end on a multi-token step; a stop string completed inside an accepted draft
    ends the output exactly where plain decoding ends it."""
    plain, spec = engines
    prompt = repetitive_prompt(random.Random(9), 120)   # its output falls into a 4-token loop
    full = run(plain, [Request("full", prompt_token_ids=prompt, params=greedy(30))])["full"]
    new_per_step = []
    sample = spec.speculator.sample
    spec.speculator.sample = lambda logits, seqs: (lambda out: (new_per_step.append(len(out[0])), out)[1])(
        sample(logits, seqs))
    try:
        ended_on_a_draft = 0
        for max_tokens in range(1, 31, 2):
            new_per_step.clear()
            out = run(spec, [Request("m", prompt_token_ids=prompt, params=greedy(max_tokens))])["m"]
            assert out.token_ids == full.token_ids[:max_tokens] and out.finish_reason == "length"
            assert sum(new_per_step) == max_tokens
            ended_on_a_draft += new_per_step[-1] > 1
        assert ended_on_a_draft > 0
        # A stop string that ends in the middle of the first multi-token step's tokens.
        steps = np.cumsum(new_per_step)
        first_multi = next(i for i, n in enumerate(new_per_step) if n > 2)
        j = int(steps[first_multi - 1]) + 1            # the second token of that step
        decode = spec.tokenizer.decode
        stop = decode(full.token_ids[:j + 1])[len(decode(full.token_ids[:j - 6])):]
        new_per_step.clear()
        got = run(spec, [Request("s", prompt_token_ids=prompt, params=greedy(30, stop=[stop]))])["s"]
        reference = run(plain, [Request("s", prompt_token_ids=prompt, params=greedy(30, stop=[stop]))])["s"]
        assert (got.text, got.token_ids, got.finish_reason) == (reference.text, reference.token_ids, "stop")
        assert got.output_tokens == j + 1 and sum(new_per_step) > got.output_tokens   # cut inside the step
    finally:
        del spec.speculator.sample


def test_seeded_sampling_with_drafts_is_reproducible(engines):
    _, spec = engines
    prompt = repetitive_prompt(random.Random(3), 80)
    params = SamplingParams(temperature=0.8, max_tokens=20, seed=11, ignore_eos=True)
    a = run(spec, [Request("a", prompt_token_ids=prompt, params=params)])["a"]
    b = run(spec, [Request("a", prompt_token_ids=prompt, params=params),
                   Request("other", prompt_token_ids=prompt[:40], params=greedy(20))])["a"]
    assert a.token_ids == b.token_ids and a.output_tokens == 20


def test_rejection_sampling_draws_from_the_target_distribution():
    """One draft token against a known distribution p: the first new token must follow p
    whether the draft is likely or not (accepted with p(d), else drawn from p without d)."""
    torch.manual_seed(0)
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    logits = torch.log(p).repeat(2, 1)                         # the draft's row and the bonus row
    sampler = Sampler(torch.device("cpu"), seed=0)
    speculator = Speculator("ngram", 1, sampler)
    trials = 4000
    for draft in (0, 3):
        counts = torch.zeros(5)
        for _ in range(trials):
            seq = Sequence("x", [1, 2], SamplingParams(temperature=1.0), detokenizer=None)
            seq.draft_token_ids = [draft]
            tokens = speculator.sample(logits.clone(), [seq])[0]
            counts[tokens[0]] += 1
            assert len(tokens) in (1, 2)
        # 4 standard errors of a binomial share at n = 4000 is at most 0.032
        torch.testing.assert_close(counts / trials, p, atol=0.032, rtol=0)


@pytest.fixture(scope="module")
def bundled_pair():
    return (Engine(EngineConfig(device="cpu", dtype="float32", num_kv_blocks=96)),
            Engine(EngineConfig(device="cpu", dtype="float32", num_kv_blocks=96, speculative="ngram")))


def copy_workload():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "copy_workload.py"
    spec = importlib.util.spec_from_file_location("copy_workload", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_copy_workload_is_deterministic():
    make = copy_workload().make
    assert make(4, (30, 60), seed=1) == make(4, (30, 60), seed=1) != make(4, (30, 60), seed=2)


def test_bundled_greedy_is_identical_with_speculation(bundled_pair):
    rows = copy_workload().make(3, (30, 40), seed=2)
    requests = [Request(r["id"], prompt=r["prompt"], params=greedy(24)) for r in rows]
    requests += [Request("fox", prompt="The quick brown fox", params=greedy(16)),
                 Request("chat", messages=[{"role": "user", "content": "What is the capital of France?"}],
                         params=SamplingParams(temperature=0, max_tokens=16))]
    plain, spec = bundled_pair
    reference, batch = run(plain, requests), run(spec, requests)
    alone = run(spec, requests[:1])
    for key in reference:
        assert batch[key].token_ids == reference[key].token_ids, key
    assert alone["copy-0"].token_ids == reference["copy-0"].token_ids
    assert "Paris" in batch["chat"].text
    copied = [batch[r["id"]] for r in rows]
    assert sum(o.accepted_tokens for o in copied) > 0.5 * sum(o.output_tokens for o in copied)
