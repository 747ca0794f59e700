"""SmoothQuant before w8a8 (pipeline/layers/quantization/smoothing.py): folding the factors leaves the
float model's answers as they were (every architecture: biases, tied embeddings, q/k norms,
GQA), flattens the ranges the int8 activations see, and the w8a8 engine calibrates once,
alike whatever its cache, leaving nothing of the float model in its prefix cache; on the
bundled model it still answers a factual question right."""
from __future__ import annotations

import shutil

import pytest
import torch

from pipeline import Engine, EngineConfig, Request
from pipeline.layers.quantization.smoothing import (CALIBRATION_TEXT, SMOOTHED_INPUTS, calibration_requests,
                                       recording_input_ranges, smooth_decoder)
from pipeline.sampling_params import SamplingParams
from engine_helpers import BIG_POOL, greedy, run

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # see conftest

PROMPT = [504, 2365, 6354, 1604, 314, 1345, 88, 2222, 17, 950, 4113, 61]
VARIANTS = {   # config class, extra fields: the layouts smoothing folds into
    "llama-gqa": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=False)),
}


def prompt_logprobs(engine: Engine) -> torch.Tensor:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    out = run(engine, [Request("p", prompt_token_ids=PROMPT, params=params)])["p"]
    assert out.error is None
    return torch.tensor([entry.logprob for entry in out.prompt_logprobs[1:]])


def calibrate(engine: Engine) -> dict:
    with recording_input_ranges(engine.model) as ranges:
        run(engine, [Request("c", prompt=CALIBRATION_TEXT, params=greedy(1))])
    assert engine.reset_prefix_cache()
    return ranges


def spread(ranges: dict) -> float:
    """How far the largest input channel stands above the typical one, over every linear."""
    return max((r.max() / r.median()).item() for r in ranges.values())


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_folded_factors_keep_the_float_answers_and_flatten_the_ranges(tmp_path, tiny_model_dir, variant):
    import transformers
    config_cls, extra = VARIANTS[variant]
    config = getattr(transformers, config_cls)(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
        **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():   # outlier channels, as trained models have: a few inputs 20x the rest
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight"):
                p[::16] = 20.0
            elif name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, tmp_path / name)
    # Calibrated by layer name as w8a8 does, before any batch-invariant wrapper (engine.py).
    engine = Engine(EngineConfig(device="cpu", dtype="float32", model=str(tmp_path), pack_weights=False,
                                 batch_invariant=False, **BIG_POOL))
    before = prompt_logprobs(engine)
    ranges = calibrate(engine)
    assert set(name.rpartition(".")[2] for name in ranges) == set(SMOOTHED_INPUTS)
    assert len(ranges) == 4 * config.num_hidden_layers
    assert smooth_decoder(engine.model, ranges) == config.num_hidden_layers
    after = prompt_logprobs(engine)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    # The same text now reaches the linears with flatter per-channel ranges.
    assert spread(calibrate(engine)) < 0.5 * spread(ranges)


def test_w8a8_engine_calibrates_alike_whatever_its_cache_and_keeps_no_float_blocks(tiny_model_dir):
    plain = Engine(EngineConfig(device="cpu", dtype="float32", model=str(tiny_model_dir), pack_weights=False,
                                **BIG_POOL))
    big = Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), quantization="w8a8", **BIG_POOL))
    # 40 tokens of cache: a 32-token piece fits, two do not
    small = Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), quantization="w8a8",
                                num_kv_blocks=10, block_size=4))
    for engine in (big, small):
        assert engine.num_steps == 0 and engine.scheduler.num_preemptions == 0
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        assert engine.block_manager.num_cached_blocks == 0
    for a, b, f in zip(big.model.model.layers, small.model.model.layers, plain.model.model.layers):
        assert not torch.equal(a.input_layernorm.weight, f.input_layernorm.weight)   # smoothed
        assert torch.equal(a.input_layernorm.weight, b.input_layernorm.weight)      # alike
        assert torch.equal(a.post_attention_layernorm.weight, b.post_attention_layernorm.weight)
    # A cache below one piece still calibrates (in shorter pieces), and generates.
    tiny = Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), quantization="w8a8",
                               num_kv_blocks=4, block_size=4))
    out = run(tiny, [Request("q", prompt_token_ids=PROMPT[:6], params=greedy(4, ignore_eos=True))])["q"]
    assert out.error is None and out.output_tokens == 4


def test_calibration_requests_fit_the_engine():
    pieces = calibration_requests(lambda text: list(range(100)), fits=32)
    assert [len(r.prompt_token_ids) for r in pieces] == [32, 32, 32, 4]
    assert [len(r.prompt_token_ids) for r in calibration_requests(lambda text: list(range(100)), fits=15)][0] == 15
    assert all(r.params.max_tokens == 1 and r.params.temperature == 0 for r in pieces)
    with pytest.raises(ValueError, match="no token"):
        calibration_requests(lambda text: [1, 2], fits=0)


@pytest.mark.timeout(300)
def test_w8a8_bundled_model_still_answers_paris(bundled_model_dir):
    engine = Engine(EngineConfig(device="cpu", quantization="w8a8"))
    out = run(engine, [Request("q", messages=[{"role": "user", "content": "What is the capital of France?"}],
                               params=greedy(16))])["q"]
    assert "Paris" in out.text
