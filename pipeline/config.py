"""Engine configuration: one validated dataclass, and where the engine keeps what it builds once."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
# int8, nf4: bitsandbytes; w8a8: CPU int8; fp8, w8a16, w4a16: PyTorch ops for CUDA (layers/quantization/weight_only.py)
QUANTIZATIONS = ("none", "int8", "nf4", "w8a8", "fp8", "w8a16", "w4a16")
# A mode's arithmetic, when it has changed since the mode was added: engine keys and request
# keys (answers kept for reuse) name it, so answers of the older arithmetic are not served.
QUANTIZATION_REVISIONS = {"w8a8": 2}   # 2: SmoothQuant before int8 (layers/quantization/smoothing.py)
KV_CACHE_DTYPES = ("auto", "int8")
SPECULATIVE_METHODS = ("none", "ngram")
ATTENTION_BACKENDS = ("auto", "cpu", "varlen", "reference")   # pipeline/layers/attention


def cache_root() -> Path:
    """Where the pipeline keeps what it builds once: converted models, compiled kernels
    (PIPELINE_CACHE_DIR, one of the engine's own two variables; see jobs.settings)."""
    return Path(os.environ.get("PIPELINE_CACHE_DIR") or Path.home() / ".cache" / "pipeline")


@dataclass(slots=True)
class EngineConfig:
    """model: a local Hugging Face causal-LM directory, or None for the bundled
    SmolLM2-135M-Instruct. kv_cache_gib is the memory budget of the paged KV cache;
    the number of blocks is derived from it once, at start-up."""
    model: str | None = None
    # auto: the model's own dtype where the device computes it natively (CUDA; CPUs with
    # AVX-512 BF16 or AMX), else float32, but bfloat16 for a float32 checkpoint on a GPU
    # that has it; see device.py. float32 for exact comparisons.
    dtype: str = "auto"
    device: str = "auto"              # auto: cuda when a GPU is visible, else cpu
    quantization: str = "none"
    # The KV cache's budget; None: 1 GiB on a CPU, on CUDA what gpu_memory_utilization of
    # the device leaves once the model is loaded (see memory_budget.py).
    kv_cache_gib: float | None = None
    gpu_memory_utilization: float = 0.9
    # auto: the compute dtype. int8: keys and values quantized when written, with a float32
    # scale per token and head (quantization/int8_kv_cache.py): the same budget holds ~2x the blocks of bf16,
    # ~3.8x of float32.
    kv_cache_dtype: str = "auto"
    # Tokens per KV-cache block; None: the attention backend's (16 for cpu, reference and
    # torch 2.10/2.11's packed varlen; 256 for the paged varlen of torch >= 2.12, whose
    # FlashAttention-2 paged KV needs a multiple of 256).
    block_size: int | None = None
    max_num_seqs: int | None = None     # None: 64 on a CPU, 256 on CUDA
    # None: 1024 on a CPU (a step's cost grows with its tokens), 8192 on CUDA (fewer, larger
    # prefill chunks: fewer steps off the decode graphs); see memory_budget.py.
    max_num_batched_tokens: int | None = None
    # While sequences decode, admit waiting ones only once this many slots are free (or all
    # that wait fit), so that most steps are plain decodes, which CUDA graphs replay
    # (scheduler.py). None: max_num_seqs / 8 where decode graphs were captured, else 1 (each
    # as soon as a slot frees: a CPU has no graphs to keep).
    admission_group: int | None = None
    max_model_len: int | None = None    # None: the model's own context length
    num_kv_blocks: int | None = None    # override the budget (tests use tiny pools)
    # CPU without quantization: hold linear weights packed once at load, float32 in MKL's
    # layout (about 3x the float32 weights; skipped when memory is short), bfloat16 in
    # oneDNN's (the same size). Faster decode steps. See packed_linear.py.
    pack_weights: bool = True
    # Keep computed full KV blocks findable by their token prefix, so a prompt prefix
    # shared by many requests (a system prompt, few-shot examples) is computed once per
    # engine. See block_manager.py.
    enable_prefix_caching: bool = True
    # Speculative decoding (speculative.py): "ngram" drafts up to num_speculative_tokens
    # tokens per step from the sequence's own prompt and output, verified in one pass.
    # Greedy output is identical to "none"; sampled output has the same distribution.
    # 8: on a CPU, a step of 2-5 rows costs nearly what 9 do (docs/performance.md, speculative decoding).
    speculative: str = "none"
    num_speculative_tokens: int = 8
    # Attention over the paged cache (pipeline/layers/attention). auto: varlen
    # (FlashAttention-2) on CUDA in float16/bfloat16 with a cache of that dtype where the
    # installed torch and GPU serve it (probed once, choice.py), else cpu (C kernels on a
    # CPU, PyTorch paths elsewhere). reference: plain PyTorch varlen, slow.
    attention_backend: str = "auto"
    # CUDA: replay decode-only steps from CUDA graphs captured at bucketed batch sizes
    # (cuda_graphs.py; varlen and reference backends). Ignored on a CPU.
    cuda_graphs: bool = True
    # Launch each step before the host has read the step before it back, so that the host's
    # scheduling and bookkeeping run beside the device's work (pipeline/engine/step_in_flight.py).
    # None: on CUDA, off on a CPU (whose forward is the host's own work). Never with drafts.
    overlap_steps: bool | None = None
    # A greedy or seeded request gets the same tokens and logprobs, bit for bit, whatever
    # else shares its steps, however its prompt is chunked, whether its prefix came from
    # the prefix cache, with or without speculation (pipeline/layers/batch_invariant.py).
    # CPU only for now: an engine on CUDA refuses it. Part of the engine key, so answers
    # kept for reuse say which promise they were computed under.
    batch_invariant: bool = True

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.speculative!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "admission_group",
                     "num_speculative_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.kv_cache_gib is not None and self.kv_cache_gib <= 0:
            raise ValueError("kv_cache_gib must be > 0")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
