"""Sampler: greedy, temperature, top-k/top-p/min-p filtering, repetition penalty, seeds."""
from __future__ import annotations

import math

import pytest
import torch

from pipeline.engine.detokenizer import IncrementalDetokenizer
from pipeline.layers.sampler import Sampler
from pipeline.sampling_params import SamplingParams
from pipeline.engine.sequence import Sequence

CPU = torch.device("cpu")


def make_seq(params: SamplingParams, prompt=(1, 2, 3), output=()) -> Sequence:
    seq = Sequence("s", list(prompt), params, IncrementalDetokenizer(None, list(prompt), []))
    seq.output_token_ids = list(output)
    return seq


def probs_of(logits: list[list[float]], *params: SamplingParams) -> torch.Tensor:
    return Sampler._filtered_probs(torch.tensor(logits), list(params))


def logits_for(probs: list[float]) -> list[float]:
    return [math.log(p) for p in probs]


def test_greedy_is_argmax_per_row():
    logits = torch.tensor([[0.0, 3.0, 1.0, -1.0], [5.0, 1.0, 2.0, 4.9], [-3.0, -2.0, -1.0, -1.5]])
    seqs = [make_seq(SamplingParams(temperature=0)) for _ in range(3)]
    assert Sampler(CPU, seed=0)(logits, seqs) == [1, 0, 2]


def test_greedy_rows_beside_sampled_rows():
    logits = torch.tensor([[0.0, 3.0, 1.0, -1.0], [0.0, 0.0, 50.0, 0.0], [9.0, 1.0, 2.0, 0.0]])
    seqs = [make_seq(SamplingParams(temperature=0)), make_seq(SamplingParams(temperature=1.0, seed=1)),
            make_seq(SamplingParams(temperature=0))]
    assert Sampler(CPU, seed=0)(logits, seqs) == [1, 2, 0]


def test_temperature_scales_logits():
    logits = [[0.0, 1.0, 2.0, 3.0]]
    for t in (0.5, 1.0, 2.0):
        expected = torch.softmax(torch.tensor(logits) / t, dim=-1)
        assert torch.allclose(probs_of(logits, SamplingParams(temperature=t)), expected, atol=1e-6)


def test_top_k_keeps_the_k_largest():
    logits = [[0.0, 3.0, 1.0, 2.0, -1.0]]
    probs = probs_of(logits, SamplingParams(top_k=2))[0]
    expected = torch.softmax(torch.tensor([3.0, 2.0]), dim=-1)
    assert probs[[0, 2, 4]].tolist() == [0.0, 0.0, 0.0]
    assert torch.allclose(probs[[1, 3]], expected, atol=1e-6)
    # top_k <= 0 and top_k >= vocab disable the filter.
    full = torch.softmax(torch.tensor(logits), dim=-1)
    for k in (0, -1, 5, 100):
        assert torch.allclose(probs_of(logits, SamplingParams(top_k=k)), full, atol=1e-6)


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = [logits_for([0.15, 0.5, 0.05, 0.3])]
    probs = probs_of(logits, SamplingParams(top_p=0.75))[0]           # 0.5 + 0.3 reach 0.75
    assert torch.allclose(probs, torch.tensor([0.0, 0.625, 0.0, 0.375]), atol=1e-6)
    probs = probs_of(logits, SamplingParams(top_p=0.85))[0]           # needs 0.15 as well
    assert torch.allclose(probs, torch.tensor([0.15, 0.5, 0.0, 0.3]) / 0.95, atol=1e-6)
    probs = probs_of(logits, SamplingParams(top_p=0.1))[0]            # the top token always stays
    assert probs.tolist() == [0.0, 1.0, 0.0, 0.0]


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    logits = [logits_for([0.15, 0.5, 0.05, 0.3])]
    probs = probs_of(logits, SamplingParams(min_p=0.2))[0]            # threshold 0.1
    assert torch.allclose(probs, torch.tensor([0.15, 0.5, 0.0, 0.3]) / 0.95, atol=1e-6)
    probs = probs_of(logits, SamplingParams(min_p=0.5))[0]            # threshold 0.25
    assert torch.allclose(probs, torch.tensor([0.0, 0.5, 0.0, 0.3]) / 0.8, atol=1e-6)


def test_filters_apply_per_row():
    logits = [logits_for([0.15, 0.5, 0.05, 0.3])] * 3
    probs = probs_of(logits, SamplingParams(top_k=1), SamplingParams(), SamplingParams(top_p=0.75))
    assert probs[0].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert torch.allclose(probs[1], torch.tensor([0.15, 0.5, 0.05, 0.3]), atol=1e-6)
    assert torch.allclose(probs[2], torch.tensor([0.0, 0.625, 0.0, 0.375]), atol=1e-6)


def test_sampling_follows_the_filtered_distribution():
    sampler = Sampler(CPU, seed=0)
    seq = make_seq(SamplingParams(top_k=2, seed=3))
    logits = torch.tensor([[0.0, math.log(3.0), -5.0, 0.0 + 1e-3]])
    draws = [sampler(logits.clone(), [seq])[0] for _ in range(400)]
    assert set(draws) == {1, 3}                   # top_k=2 keeps token 1 (p=.75) and 3
    assert 0.65 < draws.count(1) / len(draws) < 0.85



@pytest.mark.parametrize("vocab", [7, 1024, 3000, 49152])
def test_the_two_level_draw_is_the_first_token_whose_running_sum_reaches_u_times_the_total(vocab):
    """_inverse_cdf against one float64 running sum over the whole row (numpy), on the same
    uniform numbers: rows with zeros (whole blocks of them too), a vocabulary that is and is
    not a multiple of the block, and u near 1 and near 0. A weight-0 token is never drawn."""
    import numpy as np
    rng = np.random.default_rng(vocab)
    weights = rng.random((64, vocab)).astype(np.float32) ** 8
    weights[rng.random((64, vocab)) < 0.5] = 0.0
    weights[:8, : vocab // 2] = 0.0                   # leading blocks of zeros
    weights[8:16, vocab // 2:] = 0.0                  # trailing ones
    weights[weights.sum(1) == 0, 0] = 1.0             # no row without weight
    weights[16, :] = 0.0
    weights[16, vocab - 1] = 1.0                      # one token, the very last
    seqs = [make_seq(SamplingParams(temperature=1.0)) for _ in range(64)]
    drawn = Sampler(CPU, seed=5)._inverse_cdf(torch.from_numpy(weights.copy()), seqs).numpy()
    u = 1.0 - Sampler(CPU, seed=5)._uniforms(seqs, CPU).numpy()
    running = np.cumsum(weights.astype(np.float64), axis=1)
    expected = [np.searchsorted(running[i], u[i] * running[i, -1], side="left") for i in range(64)]
    assert weights[np.arange(64), drawn].min() > 0
    assert drawn[16] == vocab - 1
    # The block sums are float32: a draw within ~1e-6 of a block's edge may land on its
    # neighbour (the reference's own float64 sum rounds too); every other draw is the same.
    agree = np.mean(drawn == np.asarray(expected))
    assert agree >= 62 / 64, (agree, drawn[drawn != expected], np.asarray(expected)[drawn != expected])


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -1.0, 1.5, -2.0, 0.5]])
    seq = make_seq(SamplingParams(temperature=0, repetition_penalty=2.0), prompt=[0], output=[1])
    Sampler(CPU, seed=0)._apply_penalties(logits, [seq])
    assert logits.tolist() == [[1.0, -2.0, 1.5, -2.0, 0.5]]


def test_repetition_penalty_changes_the_greedy_choice():
    logits = torch.tensor([[2.0, -1.0, 1.5, -2.0], [2.0, -1.0, 1.5, -2.0]])
    penalised = make_seq(SamplingParams(temperature=0, repetition_penalty=2.0), prompt=[0, 3])
    plain = make_seq(SamplingParams(temperature=0), prompt=[0, 3])
    assert Sampler(CPU, seed=0)(logits, [penalised, plain]) == [2, 0]


def test_top_k_1_is_greedy():
    torch.manual_seed(0)
    logits = torch.randn(8, 1000)
    seqs = [make_seq(SamplingParams(temperature=1.3, top_k=1, seed=i)) for i in range(8)]
    assert Sampler(CPU, seed=0)(logits.clone(), seqs) == logits.argmax(dim=-1).tolist()


def test_seeded_draws_do_not_depend_on_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(20, 3, 500)

    def draws(batch_seed_sets):
        sampler = Sampler(CPU, seed=123)
        seqs = [make_seq(SamplingParams(temperature=1.0, seed=s)) for s in batch_seed_sets]
        out = []
        for step in range(20):
            rows = logits[step, 0].expand(len(seqs), -1).clone()   # same logits on every row
            out.append(sampler(rows, seqs))
        return out

    alone = [row[0] for row in draws([42])]
    in_batch = [row[1] for row in draws([7, 42, None])]
    assert alone == in_batch
    other_seed = [row[0] for row in draws([43])]
    assert alone != other_seed


def test_unseeded_sampling_follows_the_sampler_seed():
    def draws(sampler_seed):
        sampler = Sampler(CPU, seed=sampler_seed)
        seq = make_seq(SamplingParams())
        return [sampler(torch.zeros(1, 1000), [seq])[0] for _ in range(5)]

    assert draws(5) == draws(5)
    assert draws(5) != draws(6)


def test_sampler_leaves_the_global_torch_rng_alone():
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    Sampler(CPU)                                  # unseeded: must not reseed torch's global RNG
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5),
                                 dict(min_p=-0.1), dict(max_tokens=0), dict(repetition_penalty=0)])
def test_invalid_sampling_params_are_rejected(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_frequency_presence_and_logit_bias_are_openais_definitions():
    vocab = 6
    base = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]] * 3)
    output = (2, 2, 2, 4)   # token 2 three times, token 4 once
    seqs = [make_seq(SamplingParams(temperature=0, frequency_penalty=0.5, presence_penalty=0.25), output=output),
            make_seq(SamplingParams(temperature=0, logit_bias={"5": -100, "0": 7.5}), output=output),
            make_seq(SamplingParams(temperature=0), output=output)]   # all at their defaults: unchanged
    logits = base.clone()
    Sampler(CPU, seed=0)._apply_penalties(logits, seqs)
    want = base.clone()
    want[0, 2] -= 0.5 * 3 + 0.25
    want[0, 4] -= 0.5 * 1 + 0.25
    want[1, 5] -= 100
    want[1, 0] += 7.5
    assert torch.equal(logits, want) and logits.shape == (3, vocab)


@pytest.mark.parametrize("newest", [2, 3, 7], ids=["seen-in-output", "seen-in-prompt", "new"])
def test_a_pending_token_is_penalised_as_if_the_host_had_it(newest):
    """Overlapped steps: the newest output token still on the device (PENDING_TOKEN on the
    host, its id in the previous step's tokens) gives exactly the logits of the same token
    known, for every penalty together and each alone, whether or not it was seen before."""
    from pipeline.engine.sequence import PENDING_TOKEN
    output = (2, 2, 4)
    settings = [dict(repetition_penalty=1.7, frequency_penalty=0.5, presence_penalty=0.25, logit_bias={"7": 1.5}),
                dict(repetition_penalty=0.6), dict(frequency_penalty=0.75), dict(presence_penalty=1.25), {}]
    logits = torch.randn(len(settings), 9, generator=torch.Generator().manual_seed(0))
    known = [make_seq(SamplingParams(temperature=0, **kw), prompt=(3, 5), output=(*output, newest)) for kw in settings]
    pending = [make_seq(SamplingParams(temperature=0, **kw), prompt=(3, 5), output=(*output, PENDING_TOKEN))
               for kw in settings]
    previous = torch.tensor([0] * 5 + [newest])   # the step in flight sampled it in its row 5
    for seq in pending:
        seq.num_pending_tokens, seq.pending_row = 1, 5
    want, got = logits.clone(), logits.clone()
    Sampler(CPU, seed=0)._apply_penalties(want, known)
    Sampler(CPU, seed=0)._apply_penalties(got, pending, previous)
    assert torch.equal(got, want)
    assert not torch.equal(want[:4], logits[:4])   # every penalty moved something


def test_a_token_biased_minus_100_never_comes_and_plus_100_always_does(tiny_model_dir):
    from pipeline import Engine, EngineConfig, Request

    engine = Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), num_kv_blocks=128))

    def tokens(**params) -> list[int]:
        (out,) = engine.generate([Request("r", prompt="Once upon a time", params=SamplingParams(
            max_tokens=24, ignore_eos=True, **params))])
        return out.token_ids

    plain = tokens(temperature=0)
    assert tokens(temperature=0, logit_bias={}) == plain   # defaults change nothing
    banned = max(set(plain), key=plain.count)
    assert banned not in tokens(temperature=0, logit_bias={str(banned): -100})
    assert banned not in tokens(temperature=1.0, seed=3, logit_bias={str(banned): -100})
    assert set(tokens(temperature=0, logit_bias={"1234": 100})) == {1234}
    favoured = tokens(temperature=0, logit_bias={"1234": 5})   # +5: it wins every step...
    assert favoured.count(1234) == 24
    penalised = tokens(temperature=0, logit_bias={"1234": 5}, frequency_penalty=2.0)   # ...until 5 - 2 * count
    assert 1 <= penalised.count(1234) <= 3
    (too_big,) = engine.generate([Request("r", prompt="Hi", params=SamplingParams(logit_bias={"999999": 1}))])
    assert too_big.finish_reason == "error" and "vocabulary" in too_big.error


@pytest.mark.parametrize("mix", ["greedy", "sampled", "every kind"])
def test_a_sampling_step_brings_the_batch_back_in_one_host_transfer(monkeypatch, mix):
    """The sampler's one sync: a single .tolist() for the whole batch, whatever its rows ask
    (counted by wrapping Tensor.tolist and Tensor.item; the arithmetic is the real one)."""
    kinds = {"greedy": [SamplingParams(temperature=0)] * 3,
             "sampled": [SamplingParams(temperature=0.8, top_p=0.9)] * 3,
             "every kind": [SamplingParams(temperature=0), SamplingParams(temperature=0.7, seed=3, top_k=5),
                            SamplingParams(temperature=1.0, min_p=0.1, repetition_penalty=1.3, frequency_penalty=0.5,
                                           logit_bias={"2": -100}),
                            SamplingParams(temperature=0, logprobs=3)]}[mix]
    seqs = [make_seq(params, output=(4, 4, 5)) for params in kinds]
    logits = torch.randn(len(seqs), 50, generator=torch.Generator().manual_seed(0))
    calls = []
    for name in ("tolist", "item"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _real=real, _name=name: calls.append(_name)
                            or _real(self, *a))
    tokens = Sampler(CPU, seed=0)(logits, seqs)
    assert len(tokens) == len(seqs) and calls == ["tolist"]
