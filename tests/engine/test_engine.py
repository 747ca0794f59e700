"""End-to-end engine tests on real weights (no mocks).

Most use the tiny random 2-layer Llama (fast); a few use the bundled SmolLM2-135M-Instruct,
whose answers can be checked, batched into one module-scoped run to keep the suite fast.
"""
from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from pipeline import Engine, EngineConfig, Request, SamplingParams
from engine_helpers import (BIG_POOL, all_blocks_free, check_output, greedy, random_prompt, run, sampled,
                            step_past_a_timeout, stop_after)
from cluster import TINY_CONTEXT, TOO_LONG_FOR_TINY

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # see conftest


@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dir):
    return Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), **BIG_POOL))


@pytest.fixture(scope="module")
def small_pool_engine(tiny_model_dir):
    """24 blocks of 4 tokens: 96 tokens of KV cache in all."""
    return Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), num_kv_blocks=24, block_size=4,
                               max_num_batched_tokens=64, max_num_seqs=64))


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, **kw) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=max_new_tokens, **kw)
    return out[0, len(prompt_ids):].tolist()


# ---- batching, chunked prefill, preemption (tiny model) ---------------------------------

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
def test_greedy_matches_hugging_face_on_tiny_model(batch32, hf_tiny, rid):
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


def test_repetition_penalty_matches_hugging_face(tiny_engine, hf_tiny):
    prompt = tiny_engine.tokenizer.encode(" ".join(f"word{j}" for j in range(7)) + " hello")
    plain = run(tiny_engine, [Request("p", prompt_token_ids=prompt, params=greedy(16, ignore_eos=True))])["p"]
    assert len(set(plain.token_ids)) < len(plain.token_ids)      # greedy falls into a loop
    out = run(tiny_engine, [Request("rp", prompt_token_ids=prompt,
                                    params=greedy(16, ignore_eos=True, repetition_penalty=1.5))])["rp"]
    assert out.token_ids != plain.token_ids
    assert out.token_ids == hf_greedy(hf_tiny, prompt, 16, min_new_tokens=16, eos_token_id=None,
                                      repetition_penalty=1.5)


ARCHITECTURES = {
    # tied embeddings, q/k/v biases
    "Qwen2ForCausalLM": ("Qwen2Config", dict(tie_word_embeddings=True)),
    # q/k RMS norms, head_dim not hidden/heads
    "Qwen3ForCausalLM": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=False)),
    # llama3 rope scaling, attention and MLP biases
    "LlamaForCausalLM": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))),
}


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_architecture_variants_match_hugging_face(tmp_path, tiny_model_dir, arch):
    import transformers
    config_cls, extra = ARCHITECTURES[arch]
    config = getattr(transformers, config_cls)(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1,
        eos_token_id=2, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():                        # sharper logits than the default init: no near-ties
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.mul_(5)
            elif name.endswith("bias"):
                p.normal_(0, 0.5)
    assert type(model).__name__ == arch
    model.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, tmp_path / name)
    engine = Engine(EngineConfig(device="cpu", model=str(tmp_path), num_kv_blocks=32, max_num_batched_tokens=32))
    rng = random.Random(6)
    prompts = {f"n{n}": random_prompt(rng, n) for n in (3, 40, 100)}
    outs = run(engine, [Request(k, prompt_token_ids=p, params=greedy(8, ignore_eos=True)) for k, p in prompts.items()])
    for key, prompt in prompts.items():
        assert outs[key].token_ids == hf_greedy(model, prompt, 8, min_new_tokens=8, eos_token_id=None), key


def test_bfloat16_runs(tiny_model_dir):
    engine = Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), dtype="bfloat16", num_kv_blocks=32))
    assert engine.model.model.embed_tokens.weight.dtype == torch.bfloat16
    outs = run(engine, [Request("a", prompt_token_ids=PROMPT * 5, params=greedy(6, ignore_eos=True)),
                        Request("b", prompt_token_ids=PROMPT[:3], params=sampled(0, max_tokens=6))])
    for out in outs.values():
        check_output(out, engine)
        assert out.output_tokens == 6


def test_a_request_past_its_timeout_ends_with_its_partial_text_and_frees_its_blocks(tiny_engine):
    """timeout_s counts from the request's first step: the prefill step always runs (and
    samples one token), so a timed-out request keeps at least that; the others run on."""
    timed = Request("timed", prompt_token_ids=[5, 6, 7], params=greedy(400, ignore_eos=True), timeout_s=0.2)
    others = [Request(f"o{i}", prompt_token_ids=[8 + i, 9], params=greedy(6, ignore_eos=True)) for i in range(3)]
    outs = step_past_a_timeout(tiny_engine, [timed, *others], "timed")
    out = outs["timed"]
    assert out.finish_reason == "timeout" and out.error == "timed out after 0.2 s"
    assert out.output_tokens == 1 == len(out.token_ids)   # the prefill step's token, then the timeout
    assert out.text == tiny_engine.tokenizer.decode(out.token_ids) and out.latency_s >= 0.2
    for rid in ("o0", "o1", "o2"):
        check_output(outs[rid], tiny_engine)
        assert outs[rid].output_tokens == 6
    assert all_blocks_free(tiny_engine)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        Request("bad", prompt="x", timeout_s=0)


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


# ---- sampling and stopping (tiny model) ----------------------------------------------------

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


def test_request_output_fields(tiny_engine):
    outs = run(tiny_engine, [Request("a", prompt="Hello there", params=greedy(6, ignore_eos=True)),
                             Request("b", prompt_token_ids=PROMPT, params=greedy(3, ignore_eos=True))])
    assert outs["a"].prompt_tokens == len(tiny_engine.tokenizer.encode("Hello there"))
    assert outs["b"].prompt_tokens == len(PROMPT)
    assert outs["a"].output_tokens == 6 and outs["b"].output_tokens == 3
    for out in outs.values():
        check_output(out, tiny_engine)
        assert out.text == tiny_engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)


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


# ---- configuration errors ----------------------------------------------------------------

def test_model_path_that_is_not_a_directory(tmp_path):
    missing = tmp_path / "org" / "some-model"
    with pytest.raises(ValueError, match="not a local Hugging Face model directory") as e:
        Engine(EngineConfig(device="cpu", model=str(missing)))
    assert "downloaded" in str(e.value) and str(missing) in str(e.value)


def test_unsupported_architecture_names_the_supported_ones(tmp_path, tiny_model_dir):
    for f in tiny_model_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as e:
        Engine(EngineConfig(device="cpu", model=str(tmp_path)))
    assert "LlamaForCausalLM" in str(e.value) and "Qwen2ForCausalLM" in str(e.value)


@pytest.mark.parametrize("bad", [dict(dtype="float8"), dict(device="tpu"), dict(quantization="int4"),
                                 dict(block_size=0), dict(num_kv_blocks=0), dict(kv_cache_gib=0)])
def test_invalid_engine_config(bad):
    with pytest.raises(ValueError):
        EngineConfig(**bad)


# ---- quantization ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode, layer, weight_dtype", [("int8", "Linear8bitLt", torch.int8),
                                                       ("nf4", "Linear4bit", torch.uint8)])
def test_quantized_tiny_model_generates(tiny_model_dir, mode, layer, weight_dtype, dtype):
    engine = Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), quantization=mode, num_kv_blocks=64,
                                 dtype=str(dtype).removeprefix("torch.")))
    # Right after construction, before any forward: quantized, in eval mode.
    for linear in (engine.model.model.layers[0].self_attn.qkv_proj, engine.model.model.layers[1].mlp.down_proj):
        assert type(linear).__name__ == layer
        assert linear.weight.dtype == weight_dtype          # really quantized, not just swapped
        assert not linear.training
        if mode == "nf4":   # quantized from the model's own dtype, not via float16
            assert linear.weight.quant_state.dtype == dtype and linear.compute_dtype == dtype
        else:
            assert linear.weight.SCB is not None and linear.weight.CB is not None
    assert engine.model.lm_head.weight.dtype == dtype
    outs = run(engine, [Request("q", prompt_token_ids=PROMPT, params=greedy(8, ignore_eos=True)),
                        Request("r", prompt="Hello", params=sampled(1, max_tokens=5))])
    for out in outs.values():
        check_output(out, engine)
    assert outs["q"].output_tokens == 8 and outs["r"].output_tokens == 5
    assert all_blocks_free(engine)


# ---- the bundled SmolLM2-135M-Instruct ----------------------------------------------------

HF_PROMPTS = {"fox": "The quick brown fox", "fib": "def fibonacci(n):",
              "story": "Once upon a time, in a small village,", "colors": "The three primary colors are"}
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def bundled_engine():
    return Engine(EngineConfig(device="cpu", dtype="float32", num_kv_blocks=64))


@pytest.fixture(scope="module")
def bundled_outputs(bundled_engine):
    """One batched run covering every bundled-model check (24 steps at most)."""
    requests = [Request(k, prompt=p, params=greedy(24)) for k, p in HF_PROMPTS.items()]
    requests += [Request("chat", messages=CAPITAL, params=greedy(16)),
                 Request("chat-ignore-eos", messages=CAPITAL, params=greedy(12, ignore_eos=True)),
                 Request("fox-stop", prompt=HF_PROMPTS["fox"], params=greedy(24, stop=["brown bear"]))]
    outs = run(bundled_engine, requests)
    assert all_blocks_free(bundled_engine)
    return outs


@pytest.fixture(scope="module")
def hf_bundled(bundled_model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(bundled_model_dir, dtype=torch.float32).eval()


def test_bundled_greedy_matches_hugging_face_generate(bundled_engine, bundled_outputs, hf_bundled):
    for key, prompt in HF_PROMPTS.items():
        ids = bundled_engine.tokenizer(prompt).input_ids
        ref = hf_greedy(hf_bundled, ids, 24)          # stops at EOS like the engine does
        out = bundled_outputs[key]
        check_output(out, bundled_engine)
        assert out.prompt_tokens == len(ids)
        assert out.token_ids == ref, key


# A bf16 model's logits carry about this much rounding noise: where float32's best two
# tokens are closer than this, two correct bf16 paths may pick either.
NEAR_TIE = 0.25


def test_bundled_bf16_c_kernels_and_pytorch_path_agree_up_to_near_ties(hf_bundled, monkeypatch):
    """The bf16 kernels (decode attention, residual-add norm, rotary + KV write, SiLU) and the
    PyTorch bf16 path give the same greedy tokens, except where float32 itself can hardly
    decide (measured: they part at float32 margins of 0.02 and 0.10; a wrong kernel parts at
    once, by whole logits). The C path, which rounds once per kernel, answers correctly."""
    from pipeline.kernels import cpu_kernels
    engine = Engine(EngineConfig(device="cpu", dtype="bfloat16", num_kv_blocks=128))
    assert cpu_kernels.serves(torch.zeros(2, dtype=torch.bfloat16))   # the bf16 kernels run first
    requests = [Request(k, prompt=p, params=greedy(24)) for k, p in HF_PROMPTS.items()]
    requests.append(Request("chat", messages=CAPITAL, params=greedy(16)))
    with_kernels = run(engine, requests)
    monkeypatch.setattr(cpu_kernels, "can_run_paged_decode_attention", lambda q, k_cache: False)
    monkeypatch.setattr(cpu_kernels, "serves", lambda *tensors: False)
    without = run(engine, requests)
    assert "Paris" in with_kernels["chat"].text
    for request in requests:
        a, b = with_kernels[request.id].token_ids, without[request.id].token_ids
        parted = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if parted is None:
            assert a == b, request.id
            continue
        ids = engine.tokenize(request) + a[:parted]
        with torch.inference_mode():
            best_two = hf_bundled(torch.tensor([ids])).logits[0, -1].topk(2).values
        assert best_two[0] - best_two[1] < NEAR_TIE, (request.id, parted)


def test_bundled_chat_answers_paris(bundled_outputs):
    out = bundled_outputs["chat"]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"            # the model ends its turn with <|im_end|>
    assert out.token_ids[-1] == 2 and len(out.token_ids) < 16
    assert "<|im_end|>" not in out.text


def test_bundled_ignore_eos_generates_past_eos(bundled_outputs):
    eos_stopped, ignored = bundled_outputs["chat"], bundled_outputs["chat-ignore-eos"]
    assert ignored.finish_reason == "length"
    assert ignored.output_tokens == 12
    n = len(eos_stopped.token_ids)
    assert ignored.token_ids[:n] == eos_stopped.token_ids    # same answer, then beyond the EOS


def test_bundled_stop_string(bundled_outputs):
    full, stopped = bundled_outputs["fox"], bundled_outputs["fox-stop"]
    assert "brown bear" in full.text
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[:full.text.index("brown bear")]
    assert stopped.token_ids == full.token_ids[:len(stopped.token_ids)]


def test_bundled_int8_agrees_with_float32(bundled_outputs):
    """LLM.int8 without the outlier path is lossy: greedy agreement with float32 is high
    but not total (on "fox" it diverges at the 3rd token), so only the start is compared."""
    engine = Engine(EngineConfig(device="cpu", dtype="float32", quantization="int8", num_kv_blocks=16))
    outs = run(engine, [Request(k, prompt=p, params=greedy(5)) for k, p in HF_PROMPTS.items()]
               + [Request("chat", messages=CAPITAL, params=greedy(8))])
    for key, out in outs.items():
        check_output(out, engine)
        assert out.token_ids[:2] == bundled_outputs[key].token_ids[:2], key
    for key in ("chat", "fib", "story"):
        assert outs[key].token_ids[:5] == bundled_outputs[key].token_ids[:5], key
    assert "Paris" in outs["chat"].text


def test_bundled_int8_kv_cache_keeps_the_answer(bundled_outputs):
    engine = Engine(EngineConfig(device="cpu", dtype="float32", kv_cache_dtype="int8", num_kv_blocks=16))
    out = run(engine, [Request("chat", messages=CAPITAL, params=greedy(16))])["chat"]
    assert "Paris" in out.text
    assert out.text == bundled_outputs["chat"].text


# ---- INT8 KV cache ----------------------------------------------------------------------

def recording_logits(engine: Engine, monkeypatch) -> list[torch.Tensor]:
    """Every step's logits, as the sampler receives them."""
    seen, sample = [], engine.sampler.__call__
    monkeypatch.setattr(engine.speculator, "sampler",   # what the engine's step samples with
                        lambda logits, seqs: (seen.append(logits.clone()), sample(logits, seqs))[1])
    return seen


def test_int8_kv_cache_logits_stay_close_to_the_auto_cache(tiny_engine, tiny_model_dir, monkeypatch):
    """One 100-token prompt in two chunks (the second reads the first from the cache), then
    decodes: every step's logits within a small bound of the float32 cache's, greedy tokens equal."""
    engine8 = Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), kv_cache_dtype="int8", **BIG_POOL))
    assert engine8.runner.kv_cache.k.dtype == torch.int8
    request = Request("q", prompt_token_ids=random_prompt(random.Random(3), 100), params=greedy(12, ignore_eos=True))
    ref_logits, got_logits = recording_logits(tiny_engine, monkeypatch), recording_logits(engine8, monkeypatch)
    ref, got = run(tiny_engine, [request])["q"], run(engine8, [request])["q"]
    assert got.token_ids == ref.token_ids
    assert len(got_logits) == len(ref_logits) == 12
    for a, b in zip(ref_logits, got_logits):
        err = (a - b).abs().max().item()
        assert 0 < err < 0.005 * a.abs().max().item(), err   # measured ~0.0008: lossy, but slightly
    assert all_blocks_free(engine8)
    # The PyTorch path (quantize in write_kv, dequantize per gathered block) agrees with the C one.
    from pipeline.kernels import cpu_kernels
    c_logits = list(got_logits)
    got_logits.clear()
    monkeypatch.setattr(cpu_kernels, "can_run_paged_decode_attention", lambda q, k_cache: False)
    monkeypatch.setattr(cpu_kernels, "can_write_kv", lambda qkv, k_cache: False)
    assert run(engine8, [request])["q"].token_ids == ref.token_ids
    for a, b in zip(c_logits, got_logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


def peak_running(engine: Engine, requests: list[Request]) -> int:
    for request in requests:
        assert engine.add_request(request) == []
    peak = 0
    while engine.has_unfinished_requests:
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    return peak


def test_int8_kv_budget_admits_at_least_twice_the_sequences(tiny_model_dir):
    """The same kv_cache_gib: eight float32 blocks hold 4 of these 2-block sequences at once;
    int8 (a quarter of the bytes plus a float32 scale per token and head) more than twice as many."""
    rng = random.Random(5)
    requests = [Request(f"r{i}", prompt_token_ids=random_prompt(rng, 20), params=greedy(4, ignore_eos=True))
                for i in range(16)]
    budget = dict(device="cpu", model=str(tiny_model_dir), block_size=16, max_num_seqs=64,
                  kv_cache_gib=8 * 2 * 2 * 16 * 2 * 16 * 4 / 2**30)   # 8 float32 blocks of the tiny model
    auto = Engine(EngineConfig(**budget))
    int8 = Engine(EngineConfig(**budget, kv_cache_dtype="int8"))
    assert auto.block_manager.num_blocks == 8
    assert int8.block_manager.num_blocks >= 2 * auto.block_manager.num_blocks
    assert peak_running(auto, requests) == 4
    assert peak_running(int8, requests) >= 8
    assert int8.block_manager.peak_utilization > 0.6
