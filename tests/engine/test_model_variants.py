"""Other models and settings on the tiny model's shapes: architecture variants against
Hugging Face, bfloat16, quantized linears, and the configuration errors."""
from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from pipeline import Engine, EngineConfig, Request
from engine_helpers import all_blocks_free, check_output, greedy, random_prompt, run, sampled

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # see conftest

PROMPT = [504, 2365, 6354, 1604, 3987, 46477, 6403, 1980]

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
def test_architecture_variants_match_hugging_face(tmp_path, tiny_model_dir, arch, hf_greedy):
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode, layer, weight_dtype", [("int8", "Linear8bitLt", torch.int8),
                                                       ("nf4", "Linear4bit", torch.uint8)])
def test_quantized_tiny_model_generates(tiny_model_dir, mode, layer, weight_dtype, dtype):
    engine = Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), quantization=mode, num_kv_blocks=64,
                                 dtype=str(dtype).removeprefix("torch.")))
    # Right after construction: quantized, in eval mode. Construction may have run forwards:
    # batch invariance measures each linear shape at load unless its cache already knows the
    # shape. bitsandbytes' first forward moves int8's scales from the weight into the layer's
    # state, and repacks nf4 for its CPU kernel (its quant_state then says bfloat16 and keeps
    # the dtype it was quantized from as original_dtype); both hold either way.
    for linear in (engine.model.model.layers[0].self_attn.qkv_proj, engine.model.model.layers[1].mlp.down_proj):
        linear = linear.inner   # inside the batch-invariant wrapper (pipeline/layers/batch_invariant.py)
        assert type(linear).__name__ == layer
        assert linear.weight.dtype == weight_dtype          # really quantized, not just swapped
        assert not linear.training
        if mode == "nf4":   # quantized from the model's own dtype, not via float16
            state = linear.weight.quant_state
            packed = getattr(state, "packing_format_for_cpu", False)
            assert (state.original_dtype if packed else state.dtype) == dtype and linear.compute_dtype == dtype
        else:
            scales = linear.weight.SCB if linear.weight.SCB is not None else linear.state.SCB
            assert scales is not None and scales.shape == (linear.out_features,)
    assert engine.model.lm_head.weight.dtype == dtype
    outs = run(engine, [Request("q", prompt_token_ids=PROMPT, params=greedy(8, ignore_eos=True)),
                        Request("r", prompt="Hello", params=sampled(1, max_tokens=5))])
    for out in outs.values():
        check_output(out, engine)
    assert outs["q"].output_tokens == 8 and outs["r"].output_tokens == 5
    assert all_blocks_free(engine)


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
