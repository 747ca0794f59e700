"""Overlapped steps (step_in_flight.py): each step launched before the one before it is read back.

On a CPU the forward is the host's own work, so nothing runs side by side here; what these
tests hold is that the pipelining changes nothing a request gets: the same greedy and
seeded tokens, text and finish reasons as serial steps, with early stops (stop tokens and
stop strings, which the host only sees a step late), penalties, grammars, logprobs, n > 1,
preemption, prefix caching, timeouts, cancellation, and prompt logprobs (which make every
step wait for the one before).
"""
from __future__ import annotations

import random

import pytest

from pipeline import Engine, EngineConfig, Request, SamplingParams
from pipeline.engine.block_manager import block_hash
from pipeline.engine.sequence import PENDING_TOKEN
from engine_helpers import BIG_POOL, all_blocks_free, check_output, greedy, random_prompt, run, sampled, stop_after

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # see conftest

SHARED_PREFIX = list(range(300, 340))   # 40 tokens: two full blocks of 16 that requests share


def mixed_requests(count: int = 40, seed: int = 1) -> list[Request]:
    """Greedy to a length, greedy ended early by a stop token, seeded sampling, greedy cut by
    a stop string, and penalties (repetition; frequency and presence with a bias); every
    third prompt starts with the shared prefix."""
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        prompt = (SHARED_PREFIX if i % 3 == 0 else []) + random_prompt(rng, rng.randrange(3, 50))
        params = [greedy(rng.randrange(1, 30)),
                  greedy(24, stop_token_ids=[rng.randrange(100, 49000) for _ in range(400)]),
                  sampled(i, rng.randrange(1, 25)),
                  greedy(25, stop=["e"]),
                  greedy(20, repetition_penalty=1.5),
                  sampled(i, 20, frequency_penalty=1.5, presence_penalty=0.5, logit_bias={"300": 2.0})][i % 6]
        requests.append(Request(f"r{i}", prompt_token_ids=prompt, params=params))
    return requests


def engine_for(model_dir, overlap: bool, **config) -> Engine:
    return Engine(EngineConfig(device="cpu", model=str(model_dir), overlap_steps=overlap, **config))


def answers(outputs: dict) -> dict:
    return {rid: (out.token_ids, out.text, out.finish_reason) for rid, out in outputs.items()}


def by_choice(engine: Engine, requests: list[Request]) -> dict:
    """Each answer (tokens, text, finish reason, logprobs) by (id, choice)."""
    return {(out.id, out.choice): (out.token_ids, out.text, out.finish_reason, out.logprobs)
            for out in engine.generate(requests)}


@pytest.fixture(scope="module")
def serial_and_overlapped(tiny_model_dir):
    """The mixed requests through a roomy pool, serial and overlapped: the engines and outputs."""
    runs = {}
    for overlap in (False, True):
        engine = engine_for(tiny_model_dir, overlap, **BIG_POOL)
        runs[overlap] = engine, run(engine, mixed_requests())
    return runs


def test_overlapped_steps_give_the_serial_answers(serial_and_overlapped):
    (serial, serial_out), (overlapped, overlapped_out) = serial_and_overlapped[False], serial_and_overlapped[True]
    assert len(overlapped_out) == 40 and answers(overlapped_out) == answers(serial_out)
    for out in overlapped_out.values():
        check_output(out, overlapped)
    reasons = {out.finish_reason for out in overlapped_out.values()}
    assert reasons == {"stop", "length"}   # early stops really happened, a step before the host saw them
    assert serial.num_overlapped_steps == 0
    assert overlapped.num_overlapped_steps >= 0.8 * overlapped.num_steps, (overlapped.num_overlapped_steps,
                                                                           overlapped.num_steps)
    assert all_blocks_free(overlapped)


def test_the_prefix_cache_holds_only_known_tokens(serial_and_overlapped):
    """A block is findable only once the host knows every token in it: every hash the
    overlapped engine cached chains real tokens of some request (never a pending one), and
    it cached everything the serial engine did."""
    (serial, _), (overlapped, outputs) = serial_and_overlapped[False], serial_and_overlapped[True]
    bs = overlapped.block_size
    real = set()
    for request in mixed_requests():
        tokens = request.prompt_token_ids + outputs[request.id].token_ids
        parent = None
        for i in range(len(tokens) // bs):
            parent = block_hash(parent, tokens[i * bs:(i + 1) * bs])
            real.add(parent)
    cached = set(overlapped.block_manager.cached_block_ids)
    assert cached <= real
    assert set(serial.block_manager.cached_block_ids) <= cached
    assert block_hash(None, SHARED_PREFIX[:bs]) in cached


def test_a_small_pool_preempts_and_still_gives_the_serial_answers(tiny_model_dir, serial_and_overlapped):
    """40 blocks of 16 tokens for up to 16 sequences: sequences are preempted while their
    newest token is still on the device, and recomputed once it is known."""
    small = dict(num_kv_blocks=40, block_size=16, max_num_batched_tokens=64, max_num_seqs=16)
    engine = engine_for(tiny_model_dir, True, **small)
    outputs = run(engine, mixed_requests())
    assert engine.scheduler.num_preemptions > 0 and engine.num_overlapped_steps > 0
    assert answers(outputs) == answers(serial_and_overlapped[False][1])
    assert all_blocks_free(engine)


def test_prompt_logprobs_make_each_step_wait(tiny_model_dir):
    """Prompt logprobs come back over several steps with the sampled tokens: while such a
    request runs, every step is read back before the next is launched, and the requests
    beside it get the same answers either way."""
    plain = mixed_requests()[:8]
    readers = [Request("prompt", prompt_token_ids=[8, 9, 10, 11], params=greedy(6, prompt_logprobs=1))]
    engine = engine_for(tiny_model_dir, True, **BIG_POOL)
    assert len(by_choice(engine, readers)) == 1 and engine.num_overlapped_steps == 0
    together = by_choice(engine, plain + readers)
    expected = by_choice(engine_for(tiny_model_dir, False, **BIG_POOL), plain + readers)
    assert len(together) == 9 and together == expected
    assert all_blocks_free(engine)


def test_logprobs_come_back_with_their_tokens(tiny_model_dir):
    """Each step's logprobs travel with its tokens, a step late; a sequence found finished
    gets none for its dropped row. Greedy, seeded and penalised rows, stops included."""
    rng = random.Random(11)
    requests = [Request(f"l{i}", prompt_token_ids=random_prompt(rng, 4 + 3 * i), params=[
        greedy(12, logprobs=3), sampled(i, 10, logprobs=1),
        greedy(14, logprobs=2, frequency_penalty=1.0, stop_token_ids=[rng.randrange(100, 49000) for _ in range(500)]),
        greedy(9)][i % 4]) for i in range(12)]
    engine = engine_for(tiny_model_dir, True, **BIG_POOL)
    overlapped = by_choice(engine, requests)
    assert overlapped == by_choice(engine_for(tiny_model_dir, False, **BIG_POOL), requests)
    assert all(len(lp) == len(tokens) for tokens, _, _, lp in overlapped.values() if lp is not None)
    assert engine.num_overlapped_steps > 0 and all_blocks_free(engine)


def test_grammars_mask_each_step_after_reading_the_one_before(tiny_model_dir):
    """A grammar's mask needs its newest token: the step reads the one before back once its
    forward is launched, then masks and samples. Choices, a regex and JSON, greedy and seeded,
    beside plain requests: the serial answers, validity included, with steps overlapped."""
    grammars = [{"choice": ["yes", "no", "maybe"]}, {"regex": r"[0-9]{2}-[a-z]{3,6}"}, {"json_object": True}]
    requests = mixed_requests()[:6] + [
        Request(f"g{i}", prompt_token_ids=[20 + i, 30, 40], params=SamplingParams(
            temperature=0.9 if i % 2 else 0.0, seed=i, max_tokens=12, structured_output=grammars[i % 3]))
        for i in range(6)]
    engine = engine_for(tiny_model_dir, True, **BIG_POOL)
    overlapped = run(engine, requests)
    serial = run(engine_for(tiny_model_dir, False, **BIG_POOL), requests)
    assert answers(overlapped) == answers(serial)
    assert {rid: out.valid for rid, out in overlapped.items()} == {rid: out.valid for rid, out in serial.items()}
    assert overlapped["g0"].text in ("yes", "no", "maybe") and overlapped["g0"].valid
    assert engine.num_overlapped_steps > 0 and all_blocks_free(engine)


def test_choices_overlap_once_forked(tiny_model_dir):
    """n > 1: the step that computes a prompt's last token is read back before the choices
    fork; from then on they overlap, each choice drawing what it draws in serial steps."""
    rng = random.Random(7)
    requests = [Request(f"c{i}", prompt_token_ids=random_prompt(rng, 5 + 7 * i),
                        params=sampled(i, max_tokens=6 + i, n=3) if i % 2 else greedy(8 + i, n=2))
                for i in range(6)]
    engine = engine_for(tiny_model_dir, True, **BIG_POOL)
    overlapped = by_choice(engine, requests)
    assert len(overlapped) == 15 and engine.num_overlapped_steps > 0
    assert overlapped == by_choice(engine_for(tiny_model_dir, False, **BIG_POOL), requests)
    assert all_blocks_free(engine)


def test_a_timeout_drops_the_token_in_flight(tiny_model_dir, engine_clock):
    timed = Request("timed", prompt_token_ids=[5, 6, 7], params=greedy(400, ignore_eos=True), timeout_s=0.2)
    engine = engine_for(tiny_model_dir, True, **BIG_POOL)
    assert engine.add_request(timed) == []
    # three steps: two tokens read back and one in flight when the timeout retires it
    assert engine.step() + engine.step() + engine.step() == []
    engine_clock.advance(0.2)
    (out,) = engine.step()
    assert out.finish_reason == "timeout" and out.output_tokens == 2
    assert PENDING_TOKEN not in out.token_ids and out.output_tokens == len(out.token_ids)
    assert out.text == engine.tokenizer.decode(out.token_ids)
    assert engine.num_overlapped_steps > 0 and all_blocks_free(engine)


def test_stopping_mid_flight_leaves_nothing_behind(tiny_model_dir):
    """Generation stopped while a step is in flight: every block comes back, and the next
    requests are not fed the dropped step's tokens."""
    engine = engine_for(tiny_model_dir, True, **BIG_POOL)
    rng = random.Random(5)
    long = [Request(f"x{i}", prompt_token_ids=random_prompt(rng, 20 + i), params=greedy(200, ignore_eos=True))
            for i in range(6)]
    assert run(engine, long, should_stop=stop_after(5)) == {}
    assert all_blocks_free(engine)
    after = mixed_requests()[:6]
    serial = engine_for(tiny_model_dir, False, **BIG_POOL)
    assert answers(run(engine, after)) == answers(run(serial, after))


def test_overlap_is_off_on_a_cpu_and_with_drafts(tiny_model_dir):
    assert not engine_for(tiny_model_dir, None, **BIG_POOL).overlap_steps
    assert not Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), overlap_steps=True,
                                   speculative="ngram", **BIG_POOL)).overlap_steps


def test_an_overlapped_step_reads_one_tensor_back(tiny_model_dir, host_reads):
    """The forward reads nothing back (the pending rows are filled on the device), and each
    step reads only the tokens of the step before it."""
    engine = engine_for(tiny_model_dir, True, **BIG_POOL)
    for i in range(4):
        engine.add_request(Request(f"h{i}", prompt_token_ids=[100 + i, 200, 300],
                                   params=SamplingParams(temperature=0.8 if i % 2 else 0.0, seed=i,
                                                         max_tokens=8, ignore_eos=True)))
    run_model, forward_reads, step_reads = engine.runner.run, [], []

    def counted_run(batch, previous_tokens=None):
        before = sum(host_reads.values())
        result = run_model(batch, previous_tokens)
        forward_reads.append(sum(host_reads.values()) - before)
        return result

    engine.runner.run = counted_run
    try:
        while engine.has_unfinished_requests:
            before = sum(host_reads.values())
            engine.step()
            step_reads.append(sum(host_reads.values()) - before)
    finally:
        del engine.runner.run
    assert max(forward_reads) == 0 and max(step_reads) == 1, (forward_reads, step_reads)
    # The prefill and 7 decodes, as serial steps: a token known to be the last (max_tokens)
    # is not computed; the last call only reads it back.
    assert engine.num_steps == 8 and engine.num_overlapped_steps == 7 and len(step_reads) == 9
