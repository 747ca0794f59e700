"""Continuous batching on the tiny model: 32 mixed-length requests with chunked prefill,
admission in groups, preemption in a tiny pool, one host read per step; each request gets
the tokens it gets alone, through the PyTorch path, and from Hugging Face."""
from __future__ import annotations

import random

import pytest

from pipeline import Engine, EngineConfig, Request, SamplingParams
from engine_helpers import all_blocks_free, check_output, greedy, random_prompt, run, sampled

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # see conftest

BATCH_LENGTHS = [1, 2, 3, 5, 8, 13, 15, 16, 17, 21, 31, 32, 33, 40, 55, 63, 64, 65, 70, 90,
                 100, 127, 128, 129, 150, 180, 200, 230, 257, 280, 300, 333]


@pytest.fixture(scope="module")
def batch32(tiny_engine):
    """32 mixed-length requests in one generate call, with every scheduled step recorded."""
    rng = random.Random(0)
    requests = [Request(f"r{i}", prompt_token_ids=random_prompt(rng, n),
                        params=greedy(rng.randint(4, 16), ignore_eos=True))
                for i, n in enumerate(BATCH_LENGTHS)]
    rng.shuffle(requests)
    steps = []
    schedule = tiny_engine.scheduler.schedule

    def recording_schedule():
        batch = schedule()
        steps.append([(s.request_id, n, s.num_computed_tokens) for s, n in zip(batch.seqs, batch.num_new_tokens)])
        return batch

    tiny_engine.scheduler.schedule = recording_schedule
    try:
        outputs = run(tiny_engine, requests)
    finally:
        del tiny_engine.scheduler.schedule
    return {r.id: r for r in requests}, outputs, steps


def test_batch_of_32_completes_within_the_token_budget(tiny_engine, batch32):
    requests, outputs, steps = batch32
    assert set(outputs) == set(requests)
    for rid, out in outputs.items():
        check_output(out, tiny_engine)
        assert out.finish_reason == "length"
        assert out.output_tokens == requests[rid].params.max_tokens
        assert out.prompt_tokens == len(requests[rid].prompt_token_ids)
    assert all(sum(n for _, n, _ in step) <= 64 for step in steps)
    # Long prompts were prefilled in several chunks, beside other sequences' decodes.
    chunks_of_longest = [n for step in steps for rid, n, _ in step if rid == "r31"]
    assert len(chunks_of_longest) >= 333 // 64 + 1 + requests["r31"].params.max_tokens - 1
    assert any(any(n == 1 for _, n, _ in step) and any(n > 1 and done > 0 for _, n, done in step)
               for step in steps), "no step mixed a prefill chunk with decodes"
    assert all_blocks_free(tiny_engine)


def test_admission_in_groups_gives_the_same_tokens_in_more_plain_decode_steps(tiny_model_dir, tiny_engine):
    """Admission in groups changes which steps run what, not what a request gets; a CPU admits
    each waiting request as soon as a slot frees (it has no decode graphs to keep)."""
    assert tiny_engine.scheduler.admission_group == 1
    rng = random.Random(3)
    requests = [Request(f"g{i}", prompt_token_ids=random_prompt(rng, rng.randint(4, 40)),
                        params=greedy(rng.randint(2, 24), ignore_eos=True)) for i in range(40)]
    config = dict(device="cpu", model=str(tiny_model_dir), num_kv_blocks=512, max_num_seqs=8)
    plain_shares, outputs = [], []
    for group in (1, 4):
        engine = Engine(EngineConfig(**config, admission_group=group))
        assert engine.scheduler.admission_group == group
        layouts = []
        prepare = engine.runner._prepare
        engine.runner._prepare = lambda *a: layouts.append(prepare(*a)) or layouts[-1]
        outputs.append({rid: out.token_ids for rid, out in run(engine, requests).items()})
        plain_shares.append(sum(layout.is_plain_decode for layout in layouts) / len(layouts))
    assert outputs[0] == outputs[1] and len(outputs[0]) == 40
    assert plain_shares[1] > plain_shares[0] + 0.2, plain_shares


@pytest.mark.parametrize("rid", ["r0", "r7", "r17", "r22", "r31"])
def test_request_alone_matches_it_inside_the_batch(tiny_engine, batch32, rid):
    requests, outputs, _ = batch32
    alone = run(tiny_engine, [requests[rid]])[rid]
    assert alone.token_ids == outputs[rid].token_ids
    assert alone.text == outputs[rid].text


def test_pytorch_path_gives_the_same_tokens_as_the_c_kernels(tiny_engine, batch32, monkeypatch):
    """The batch ran through the C kernels; the PyTorch fallback (no compiler, bfloat16,
    CUDA) must decode the same greedy tokens."""
    from pipeline.kernels import cpu_kernels
    requests, outputs, _ = batch32
    monkeypatch.setattr(cpu_kernels, "can_run_paged_decode_attention", lambda q, k_cache: False)
    monkeypatch.setattr(cpu_kernels, "serves", lambda *tensors: False)
    again = run(tiny_engine, [requests[rid] for rid in ("r3", "r17", "r30")])
    assert {rid: out.token_ids for rid, out in again.items()} == {rid: outputs[rid].token_ids for rid in again}


@pytest.mark.parametrize("rid", ["r2", "r17", "r28"])
def test_greedy_matches_hugging_face_on_tiny_model(batch32, hf_tiny, hf_greedy, rid):
    """Chunked prefill (r17: 65 tokens, r28: 257 tokens over a 64-token budget) and
    batched decoding give the reference model's tokens."""
    requests, outputs, _ = batch32
    req = requests[rid]
    ref = hf_greedy(hf_tiny, req.prompt_token_ids, req.params.max_tokens,
                    min_new_tokens=req.params.max_tokens, eos_token_id=None)
    assert outputs[rid].token_ids == ref


def test_a_step_reads_one_tensor_back_to_the_host(tiny_engine, host_reads):
    """Greedy, unseeded and seeded random rows, a repetition penalty, top-k/top-p/min-p, in
    decode-only and mixed prefill + decode steps: the model's forward reads nothing back, and
    sampling returns all of the step's tokens in one transfer."""
    rng = random.Random(5)
    params = [greedy(6, ignore_eos=True), sampled(1, max_tokens=6), sampled(None, max_tokens=6),
              SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.3,
                             max_tokens=6, ignore_eos=True),
              greedy(6, ignore_eos=True, repetition_penalty=1.2)]
    for i, p in enumerate(params):
        tiny_engine.add_request(Request(f"h{i}", prompt_token_ids=random_prompt(rng, 5 + 40 * i), params=p))
    run_model = tiny_engine.runner.run
    forward_reads = []

    def counted_run(batch, *rest):
        before = sum(host_reads.values())
        result = run_model(batch, *rest)
        forward_reads.append(sum(host_reads.values()) - before)
        return result

    tiny_engine.runner.run = counted_run
    try:
        steps = 0
        while tiny_engine.has_unfinished_requests:
            host_reads.clear()
            forward_reads.clear()
            tiny_engine.step()
            steps += 1
            assert forward_reads == [0], host_reads
            assert sum(host_reads.values()) <= 1, host_reads
    finally:
        del tiny_engine.runner.run
    assert steps >= 6 and host_reads == {"tolist": 1}


def test_tiny_pool_preempts_and_still_matches_big_pool(tiny_engine, small_pool_engine):
    rng = random.Random(1)
    requests = [Request(f"p{i}", prompt_token_ids=random_prompt(rng, n), params=greedy(m, ignore_eos=True))
                for i, (n, m) in enumerate([(5, 20), (12, 16), (40, 12), (20, 20), (33, 8), (9, 24),
                                            (50, 10), (3, 30), (27, 14), (16, 16)])]
    expected = run(tiny_engine, requests)
    preemptions = small_pool_engine.scheduler.num_preemptions
    got = run(small_pool_engine, requests)
    assert small_pool_engine.scheduler.num_preemptions > preemptions
    assert set(got) == set(expected)
    for rid, out in got.items():
        check_output(out, small_pool_engine)
        assert out.finish_reason == "length"
        assert out.token_ids == expected[rid].token_ids, rid
    assert all_blocks_free(small_pool_engine)
