"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM) over packed tokens.

Inputs are a flat list of tokens from many sequences (no padding) with their
positions; attention reads and writes the paged KV cache through the attention backend
the model runner binds to each layer (pipeline/layers/attention) and that backend's
metadata for the step.
Q/K/V and gate/up projections are fused into one matmul each.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.kernels import cpu_kernels, cuda_kernels


@dataclass(slots=True)
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "LlamaArgs":
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported activation {cfg['hidden_act']!r} (only silu)")
        num_heads = cfg["num_attention_heads"]
        # transformers >= 5 nests rope settings in rope_parameters; 4.x has rope_theta/rope_scaling.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        attention_bias = cfg.get("attention_bias", False)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rope_theta=float(theta),
            rope_scaling=rope if rope_type != "default" else None,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=cfg.get("mlp_bias", False),
            qk_norm=arch == "Qwen3ForCausalLM",
        )


def rope_inv_freq(args: LlamaArgs) -> torch.Tensor:
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim))
    scaling = args.rope_scaling
    if scaling is None:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    raise ValueError(f"unsupported rope scaling {rope_type!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Rotary embeddings as one complex multiplication per step.

    Hugging Face checkpoints rotate dimension i with i + head_dim/2 ("rotate half").
    The loader interleaves the q/k projection rows (`interleave_rotary_rows`) so that
    those pairs sit side by side; a pair is then one complex number and the rotation a
    single complex product instead of seven elementwise passes. q.k is unchanged
    because queries and keys are permuted alike.
    """

    def __init__(self, args: LlamaArgs):
        super().__init__()
        freqs = torch.outer(torch.arange(args.max_position_embeddings, dtype=torch.float64), rope_inv_freq(args))
        # Real buffers (module.to(dtype) would discard a complex table's imaginary part).
        self.register_buffer("cos", freqs.cos().float(), persistent=False)  # [max_pos, head_dim/2]
        self.register_buffer("sin", freqs.sin().float(), persistent=False)

    def forward(self, positions: torch.Tensor) -> "Rotation":
        return Rotation(self.cos[positions].float(), self.sin[positions].float())


class Rotation:
    """One step's rotary angles, shared by every layer: cos and sin [tokens, head_dim/2]
    for the C kernel, as complex numbers [tokens, 1, head_dim/2] for the PyTorch path."""
    __slots__ = ("cos", "sin", "_complex")

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        self.cos, self.sin, self._complex = cos, sin, None

    @property
    def complex(self) -> torch.Tensor:
        if self._complex is None:
            self._complex = torch.complex(self.cos, self.sin).unsqueeze(1)
        return self._complex


def apply_rotary(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim] with interleaved rotary pairs -> rotated copy."""
    pairs = x.float() if x.dtype not in (torch.float32, torch.float64) else x
    rotated = torch.view_as_real(torch.view_as_complex(pairs.unflatten(-1, (-1, 2))) * freqs)
    return rotated.flatten(-2).to(x.dtype)


def interleave_rotary_rows(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Reorder each head's rows (or entries) from [0..d/2-1, d/2..d-1] to [0, d/2, 1, d/2+1, ...]."""
    half = head_dim // 2
    order = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).flatten()
    heads = weight.reshape(-1, head_dim, *weight.shape[1:])
    return heads[:, order].reshape(weight.shape)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """rmsnorm(x); with a residual stream: (rmsnorm(x + residual), x + residual), the
        addition fused into the norm as in vLLM (the residual may be updated in place)."""
        if residual is None or residual.is_contiguous():
            fused = cpu_kernels if cpu_kernels.serves(x, self.weight) else cuda_kernels.triton_pointwise(x, self.weight)
            if fused is not None and x.is_contiguous():
                out = fused.add_rms_norm(x, residual, self.weight, self.eps)
                return out if residual is None else (out, residual)
        if residual is not None:
            residual = residual + x
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Three passes over x instead of F.rms_norm's six on CPU (it is decomposed there).
        inv_rms = torch.linalg.vector_norm(x, dim=-1, keepdim=True)     # [tokens, 1]
        inv_rms = inv_rms.square_().div_(x.shape[-1]).add_(self.eps).rsqrt_()
        return torch.mul(x, inv_rms).mul_(self.weight)


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_size = args.num_heads * args.head_dim
        self.kv_size = args.num_kv_heads * args.head_dim
        self.qkv_proj = nn.Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, args.hidden_size, bias=args.o_bias)
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.scale = args.head_dim ** -0.5
        # Bound by ModelRunner once the pool exists: the attention backend and this
        # layer's cache (pipeline.layers.attention.LayerCache) in its layout.
        self.backend = self.cache = None

    def forward(self, x, rotation: Rotation, meta):
        qkv = self.qkv_proj(x)
        heads = qkv.view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q_end, k_end = self.num_heads, self.num_heads + self.num_kv_heads
        if self.q_norm is None and self.backend.rotary_write_kv(qkv, rotation, meta, self.cache,
                                                                self.num_heads, self.num_kv_heads):
            # One fused pass (the C kernel) rotated q and k in place and stored k and v.
            q, k, v = heads[:, :q_end], heads[:, q_end:k_end], heads[:, k_end:]
        else:
            v = heads[:, k_end:]
            if self.q_norm is None:
                # Queries and keys are adjacent in the fused output: rotate them together.
                qk = apply_rotary(heads[:, :k_end], rotation.complex)
                q, k = qk[:, :q_end], qk[:, q_end:]                  # [tokens, heads|kv_heads, head_dim]
            else:
                q = apply_rotary(self.q_norm(heads[:, :q_end]), rotation.complex)
                k = apply_rotary(self.k_norm(heads[:, q_end:k_end]), rotation.complex)
            self.backend.write_kv(self.cache, k, v, meta)
        out = self.backend.forward(q, k, v, self.cache, meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.intermediate_size = args.intermediate_size
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        fused = cpu_kernels if cpu_kernels.serves(gate_up) else cuda_kernels.triton_pointwise(gate_up)
        if fused is not None and gate_up.is_contiguous():
            return self.down_proj(fused.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(self, x, residual, rotation, meta):
        """x: the previous layer's output, residual: the stream before it (None at layer 0).
        Returns this layer's (output, residual); the next norm adds them."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rotation, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary = RotaryEmbedding(args)

    def forward(self, input_ids, positions, meta):
        x, residual = self.embed_tokens(input_ids), None     # [tokens, hidden]
        rotation = self.rotary(positions)                     # once per step, shared by all layers
        for layer in self.layers:
            x, residual = layer(x, residual, rotation, meta)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    # HF checkpoint names of the separate projections -> (our fused parameter, which slice)
    fused_weights = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.args = args
        self.model = LlamaModel(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head (again after moving off the meta device,
        which unties parameters)."""
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """input_ids, positions: [tokens] -> hidden states [tokens, hidden]."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()                   # [rows, vocab]

    def prepare_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Adapt a checkpoint tensor to our layout (see RotaryEmbedding)."""
        if any(part in name for part in ("q_proj", "k_proj", "q_norm", "k_norm")):
            return interleave_rotary_rows(tensor, self.args.head_dim)
        return tensor

    def fused_slice(self, name: str, index: int) -> tuple[int, int]:
        """Row range of the `index`-th part of a fused projection weight."""
        a = self.args
        if name == "qkv_proj":
            sizes = [a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim]
        else:
            sizes = [a.intermediate_size, a.intermediate_size]
        start = sum(sizes[:index])
        return start, start + sizes[index]
