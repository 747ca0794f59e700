"""Builds our model from a local Hugging Face causal-LM directory (safetensors)."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pipeline.models.model_dir import check_model_dir
from pipeline.models.offline import offline
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


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device,
               quantize_linear: Callable[[nn.Linear], nn.Module] | None = None, quantized_layers: tuple[str, ...] = ()):
    """The model on `device` in `dtype`. With quantize_linear (quantization.linear_quantizer),
    the decoder's linears named quantized_layers (quantization.QUANTIZED_LAYERS) are
    quantized layer by layer while loading: each is filled on the CPU and handed to
    quantize_linear (which puts its quantized module on `device`) as soon as its last
    checkpoint tensor is read, so the device never holds more than one of them in float:
    a model that fits there only quantized loads."""
    hf_config = read_hf_config(model_dir)
    arch = (hf_config.get("architectures") or ["?"])[0]
    cls = model_class(arch)
    args = LlamaArgs.from_hf_config(hf_config)
    # Build without initialising weights (they are overwritten by the checkpoint), and cast
    # while still on the meta device: memory is allocated once, in the target dtype.
    with torch.device("meta"):
        model = cls(args).to(dtype)
    model = model.to_empty(device=device) if quantize_linear is None else \
        _to_empty_but_linears(model, device, quantized_layers)
    model.tie_weights()
    model.model.rotary = RotaryEmbedding(args).to(device)  # float32 table, computed (not loaded)
    _load_weights(model, model_dir, None if quantize_linear is None
                  else _QuantizeWhenLoaded(model, quantize_linear, quantized_layers))
    return model.eval(), args


def _to_empty_but_linears(model, device: torch.device, names: tuple[str, ...]):
    """to_empty(device) for all but the linears to quantize: those stay on the meta device
    (and nothing here keeps a reference to them: each is freed once it is quantized)."""
    linears = _quantized_linears(model, names).values()
    for parent, name, _ in linears:
        parent._modules[name] = None
    model = model.to_empty(device=device)
    for parent, name, linear in linears:
        parent._modules[name] = linear
    return model


def _quantized_linears(model, names: tuple[str, ...]) -> dict[str, tuple[nn.Module, str, nn.Linear]]:
    """The linears quantization swaps (nn.Linear children called one of `names`): their
    qualified names -> (parent, attribute, linear)."""
    return {f"{prefix}.{name}" if prefix else name: (parent, name, child)
            for prefix, parent in model.named_modules() for name, child in parent.named_children()
            if name in names and isinstance(child, nn.Linear)}


class _QuantizeWhenLoaded:
    """Routes the checkpoint tensors of the linears to quantize into CPU copies of them (made
    at their first tensor), counts what each has received, and swaps a linear for its
    quantized module once all of its parameters are filled (fused q/k/v and gate/up included)."""

    def __init__(self, model, quantize_linear: Callable[[nn.Linear], nn.Module], names: tuple[str, ...]):
        self.pending = _quantized_linears(model, names)
        self.quantize_linear = quantize_linear
        self.filled: dict[str, int] = {}

    def destination(self, target: str, param: torch.Tensor) -> torch.Tensor:
        owner, _, name = target.rpartition(".")
        if owner not in self.pending:
            return param
        linear = self.pending[owner][2]
        if linear.weight.is_meta:
            linear.to_empty(device="cpu")
        return getattr(linear, name)

    def loaded(self, target: str, numel: int) -> None:
        owner, _, _ = target.rpartition(".")
        if owner not in self.pending:
            return
        self.filled[target] = self.filled.get(target, 0) + numel
        parent, name, linear = self.pending[owner]
        if all(self.filled.get(f"{owner}.{p}", 0) >= t.numel() for p, t in linear.named_parameters()):
            del self.pending[owner]
            with torch.no_grad():
                setattr(parent, name, self.quantize_linear(linear))

    def check_complete(self, model_dir: Path) -> None:
        if self.pending:
            raise ValueError(f"checkpoint {model_dir} lacks parts of {', '.join(sorted(self.pending)[:5])}")


def _checkpoint_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {model_dir}")
    return files


def _load_weights(model, model_dir: Path, quantizing: _QuantizeWhenLoaded | None = None) -> None:
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
                param = params[target] if quantizing is None else quantizing.destination(target, params[target])
                tensor = model.prepare_weight(name, f.get_tensor(name))
                with torch.no_grad():
                    (param if rows is None else param[rows[0]:rows[1]]).copy_(tensor)
                missing.discard(target)
                if quantizing is not None:
                    quantizing.loaded(target, tensor.numel())
    if model.args.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks weights: {', '.join(sorted(missing)[:5])}")
    if quantizing is not None:
        quantizing.check_complete(model_dir)


def _target_of(model, name: str) -> tuple[str, tuple[int, int] | None]:
    """Our parameter for a checkpoint name, and the rows it fills in a fused weight."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in model.fused_weights:
            fused, index = model.fused_weights[part]
            parts[i] = fused
            return ".".join(parts), model.fused_slice(fused, index)
    return name, None
