"""The engine's largest step, run once on dummy tokens to measure its peak memory on CUDA
(memory_budget.kv_cache_plan sizes the KV cache from it, as a serving engine does).

The step is the worst the scheduler can make: max_num_batched_tokens prompt tokens over as
many sequences as a batch holds (at most one a token), every one of them sampling (top-k,
top-p and logprobs: the sampler's [rows, vocab] float32 copies), through the same model
runner and sampler as a real step, so the weights' own scratch (fp8's activation copies,
w8a16's cast weights) and the attention backend's are measured, not estimated. Its keys and
values go to a scratch cache just large enough for it, freed before the real cache is sized.
Not measured: CUDA graphs' pools (captured later, from the 1 - gpu_memory_utilization left
over) and prompt logprobs' logits over a whole chunk.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from pipeline.engine.model_runner import ModelRunner
from pipeline.engine.scheduler import ScheduledBatch
from pipeline.engine.sequence import Sequence
from pipeline.layers.attention import AttentionBackend
from pipeline.layers.kv_cache import KVCache
from pipeline.layers.sampler import Sampler
from pipeline.sampling_params import SamplingParams

# Every filter and logprobs on, so the sampler's largest temporaries are part of the peak.
PROFILE_SAMPLING = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, min_p=0.01, logprobs=5, max_tokens=1)


def step_lengths(num_tokens: int, num_seqs: int) -> list[int]:
    """num_tokens split as evenly as possible over min(num_seqs, num_tokens) sequences."""
    seqs = max(1, min(num_seqs, num_tokens))
    return [num_tokens // seqs + (i < num_tokens % seqs) for i in range(seqs)]


def step_peak_bytes(model, device: torch.device, backend: AttentionBackend, kv_dtype: torch.dtype, block_size: int,
                    num_tokens: int, num_seqs: int,
                    peak_of: Callable[[torch.device, Callable[[], None]], int] | None = None) -> int:
    """Bytes the profiling step allocates at its peak above what was allocated before it
    (the scratch cache is allocated before, so not counted). peak_of(device, run) measures
    run(); CUDA's allocator statistics by default (a test gives its own on a CPU). A step
    that does not fit beside the model raises ValueError, in one line with the numbers."""
    args = model.args
    lengths = step_lengths(num_tokens, num_seqs)
    blocks = [-(-n // block_size) for n in lengths]
    cache = KVCache(args.num_layers, args.num_kv_heads, args.head_dim, block_size, sum(blocks), kv_dtype, device,
                    backend)
    seqs, first = [], 0
    for i, (n, count) in enumerate(zip(lengths, blocks)):
        seq = Sequence(f"profile-{i}", [(i + j) % args.vocab_size for j in range(n)], PROFILE_SAMPLING, None)
        seq.block_table = list(range(first, first + count))
        first += count
        seqs.append(seq)
    runner = ModelRunner(model, cache, device, backend)
    sampler = Sampler(device, seed=0)

    def run() -> None:
        step = runner.run(ScheduledBatch(seqs, list(lengths)))
        sampler(step.logits, step.sampling)

    try:
        return (peak_of or cuda_peak_bytes)(device, run)
    except torch.cuda.OutOfMemoryError:
        free, total = torch.cuda.mem_get_info(device)
        raise ValueError(
            f"a step of {num_tokens:,} tokens does not fit on {device} beside the model: "
            f"{(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB are in use; lower max_num_batched_tokens "
            "or max_num_seqs, or quantize the model") from None
    finally:
        for layer in model.model.layers:   # the scratch cache must go before the device's free memory is read
            layer.self_attn.cache = None
        del runner, cache, seqs


def cuda_peak_bytes(device: torch.device, run: Callable[[], None]) -> int:
    """The most bytes PyTorch's allocator held while run() ran, above what it held before."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before
