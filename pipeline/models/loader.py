"""Builds our model from a local Hugging Face causal-LM directory (safetensors)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from pipeline.models.model_dir import check_model_dir, offline
from pipeline.models.architectures import model_class
from pipeline.models.llama import LlamaArgs, RotaryEmbedding


def resolve_model_dir(model: str | None) -> Path:
    """A local model directory; None means the bundled model."""
    if model is None:
        from pipeline.models.bundled import bundled_model_dir
        return bundled_model_dir()
    return check_model_dir(model, weights=False)   # _checkpoint_files says it, after the architecture


def load_tokenizer(model_dir: Path):
    offline()
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


def read_hf_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device):
    hf_config = read_hf_config(model_dir)
    arch = (hf_config.get("architectures") or ["?"])[0]
    cls = model_class(arch)
    args = LlamaArgs.from_hf_config(hf_config)
    # Build without initialising weights (they are overwritten by the checkpoint), and cast
    # while still on the meta device: memory is allocated once, in the target dtype.
    with torch.device("meta"):
        model = cls(args).to(dtype)
    model = model.to_empty(device=device)
    model.tie_weights()
    model.model.rotary = RotaryEmbedding(args).to(device)  # float32 table, computed (not loaded)
    _load_weights(model, model_dir)
    return model.eval(), args


def _checkpoint_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {model_dir}")
    return files


def _load_weights(model, model_dir: Path) -> None:
    params = dict(model.named_parameters())
    missing = set(params)
    for file in _checkpoint_files(model_dir):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if "rotary_emb" in name:
                    continue
                if name == "lm_head.weight" and model.args.tie_word_embeddings:
                    continue
                target, rows = _target_of(model, name)
                if target not in params:
                    raise ValueError(f"unexpected weight {name!r} in {file.name}")
                param = params[target]
                tensor = model.prepare_weight(name, f.get_tensor(name))
                with torch.no_grad():
                    (param if rows is None else param[rows[0]:rows[1]]).copy_(tensor)
                missing.discard(target)
    if model.args.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks weights: {', '.join(sorted(missing)[:5])}")


def _target_of(model, name: str) -> tuple[str, tuple[int, int] | None]:
    """Our parameter for a checkpoint name, and the rows it fills in a fused weight."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in model.fused_weights:
            fused, index = model.fused_weights[part]
            parts[i] = fused
            return ".".join(parts), model.fused_slice(fused, index)
    return name, None
