"""SmoothQuant for w8a8: move the activations' outlier channels into the weights before int8.

Per-token int8 activations give each token one scale, set by its largest channel, so a
few large channels coarsen all the others: with every linear int8 the bundled model's
perplexity rose 4.2% on a fixed text (AVX-512 VNNI, 255 levels). SmoothQuant (Xiao et
al., 2023) divides each input channel j of a linear by
    s_j = max|X_j| ** alpha / max|W_:,j| ** (1 - alpha)
and multiplies the weight's column j by it: the same product in exact arithmetic, with
a flatter activation range. The division is folded into whatever makes that input, so no
operation is added at run time:
* qkv_proj: the input RMSNorm's weight;      * gate_up_proj: the post-attention RMSNorm's;
* down_proj: the up half of gate_up_proj (silu(gate) * up / s = silu(gate) * (up / s));
* o_proj: the value rows of qkv_proj (attention mixes value rows linearly), one factor per
  value channel, the largest of the query heads that share it under GQA.
max|X_j| comes from one forward of CALIBRATION_TEXT at load, in pieces of CALIBRATION_TOKENS
(the engine runs it), recorded on the float model before anything is quantized.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from pipeline.request import Request
from pipeline.sampling_params import SamplingParams

ALPHA = 0.5   # the paper's default; 0.3-0.75 measured on the bundled model, 0.5 the steadiest
SMOOTHED_INPUTS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
CALIBRATION_TOKENS = 32   # run as independent pieces this long: any engine's cache holds one
# Varied English, numbers, a little code and French: the ranges of ordinary requests.
CALIBRATION_TEXT = (
    "Please answer the question below. You are a helpful assistant. The quick brown fox jumps over the "
    "lazy dog. In 1969, astronauts landed on the Moon; the mission took eight days. def add(a, b):\n"
    "    return a + b\nTranslate into French: the weather is nice today. Les enfants jouent dans le parc. "
    "Summary: sales rose 8% in the third quarter, driven by strong demand in Asia, while costs fell. "
    "1, 2, 3, 4, 5. What is 12 times 7? 84.")


def calibration_requests(encode: Callable[[str], list[int]], fits: int) -> list[Request]:
    """CALIBRATION_TEXT's tokens as greedy one-token requests of CALIBRATION_TOKENS each (fewer
    where an engine holds only `fits` tokens): every engine of a model smooths alike whatever
    its cache, if that holds one piece."""
    if fits < 1:
        raise ValueError("this engine holds no token to calibrate w8a8 with")
    ids, piece = encode(CALIBRATION_TEXT), min(CALIBRATION_TOKENS, fits)
    params = SamplingParams(temperature=0, max_tokens=1)
    return [Request(f"calibration-{i}", prompt_token_ids=ids[i:i + piece], params=params)
            for i in range(0, len(ids), piece)]


@contextlib.contextmanager
def recording_input_ranges(model: nn.Module):
    """Within the block, every forward records each smoothed linear's largest |input| per
    channel; yields {module name: tensor [in_features]} (filled as forwards run)."""
    ranges: dict[str, torch.Tensor] = {}

    def record(name):
        def hook(_module, inputs):
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).abs().amax(0).float()
            ranges[name] = torch.maximum(ranges[name], x) if name in ranges else x
        return hook

    handles = [module.register_forward_pre_hook(record(name)) for name, module in model.named_modules()
               if name.rpartition(".")[2] in SMOOTHED_INPUTS and isinstance(module, nn.Linear)]
    try:
        yield ranges
    finally:
        for handle in handles:
            handle.remove()


def _factors(input_range: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """s_j for each input channel j of weight [out, in]; 1 for a channel the calibration never
    saw non-zero (a tiny factor would blow it up should it ever be active)."""
    weight_range = weight.detach().abs().amax(0).float().clamp(min=1e-5)
    s = (input_range.clamp(min=1e-5) ** alpha / weight_range ** (1 - alpha)).clamp(min=1e-5)
    return torch.where(input_range > 0, s, torch.ones_like(s))


def _scale_columns(linear: nn.Linear, s: torch.Tensor) -> None:
    linear.weight.mul_(s.to(linear.weight.dtype))


def _divide_rows(linear: nn.Linear, rows: slice, s: torch.Tensor) -> None:
    linear.weight[rows].div_(s.to(linear.weight.dtype)[:, None])
    if linear.bias is not None:
        linear.bias[rows].div_(s.to(linear.bias.dtype))


@torch.no_grad()
def smooth_decoder(model: nn.Module, ranges: dict[str, torch.Tensor], alpha: float = ALPHA) -> int:
    """Fold the factors into every decoder layer of `model` (pipeline.models.llama's), from
    recorded `ranges`; returns the number of layers smoothed."""
    layers = model.model.layers
    for i, layer in enumerate(layers):
        prefix = f"model.layers.{i}"
        attn, mlp = layer.self_attn, layer.mlp
        s = _factors(ranges[f"{prefix}.self_attn.qkv_proj"], attn.qkv_proj.weight, alpha)
        layer.input_layernorm.weight.div_(s.to(layer.input_layernorm.weight.dtype))
        _scale_columns(attn.qkv_proj, s)

        s = _factors(ranges[f"{prefix}.mlp.gate_up_proj"], mlp.gate_up_proj.weight, alpha)
        layer.post_attention_layernorm.weight.div_(s.to(layer.post_attention_layernorm.weight.dtype))
        _scale_columns(mlp.gate_up_proj, s)

        s = _factors(ranges[f"{prefix}.mlp.down_proj"], mlp.down_proj.weight, alpha)
        intermediate = mlp.down_proj.in_features
        _divide_rows(mlp.gate_up_proj, slice(intermediate, 2 * intermediate), s)
        _scale_columns(mlp.down_proj, s)

        heads, kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        group = heads // kv_heads
        s = _factors(ranges[f"{prefix}.self_attn.o_proj"], attn.o_proj.weight, alpha)
        s = s.view(kv_heads, group, head_dim).amax(1)                      # [kv heads, head_dim]
        values = attn.q_size + attn.kv_size
        _divide_rows(attn.qkv_proj, slice(values, values + attn.kv_size), s.reshape(-1))
        _scale_columns(attn.o_proj, s[:, None, :].expand(kv_heads, group, head_dim).reshape(-1))
    return len(layers)
