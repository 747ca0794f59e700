"""Which attention backend serves a CUDA device: chosen once per process from what the
installed torch and the GPU offer, and said once in the log.

In float16/bfloat16 with a cache of that dtype:
- VarlenBackend where torch's varlen_attn reads pages (block_table: torch >= 2.12);
- PackedVarlenBackend where it reads contiguous keys only (torch 2.10, 2.11): pages
  gathered for steps with prefill chunks, decode-only steps read in place by a Triton
  kernel and replayed from CUDA graphs (without Triton, or if that kernel fails the
  probe, decodes gather too and nothing is graphed);
- otherwise, on a GPU older than Ampere (FlashAttention-2 needs compute capability 8.0),
  or when the chosen backend fails a probe: the cpu backend's PyTorch paths (correct on
  any device, per-chunk SDPA and gathered-block decode; slow: no CUDA graphs).
The probe runs the chosen backend once on the device on two tiny steps (a decode with a
3-row chunk crossing a page, then decodes only) against ReferenceVarlenBackend, with every
key some row must not see made loud (probe_inputs): an error, a causal mask aligned the
wrong way, a lost causal mask or a read past seqused_k all show. float32 or an int8
cache on CUDA take the PyTorch paths too (FlashAttention has neither), also said once.
"""
from __future__ import annotations

import functools
import logging

import numpy as np
import torch

from pipeline.layers.attention import AttentionBackend, HostToDevice, LayerCache, StepLayout
from pipeline.layers.attention.flash_entry import PACKED, PAGED, entry_kind, installed_varlen_attn

log = logging.getLogger("pipeline.layers.attention")
PROBE_HEADS = (4, 2, 64)   # query heads, KV heads, head_dim when the model's are not given
HIDDEN = 100.0             # the probe's value of every key that some row must not see


@functools.cache
def say_once(level: int, message: str) -> None:
    log.log(level, message)


def varlen_backend(kernel=None, paged_decode: bool = True) -> AttentionBackend:
    """The FlashAttention varlen backend for this torch's varlen_attn (no probe); on a
    packed one, paged_decode: decode steps through the Triton kernel where it imports."""
    from pipeline.layers.attention.varlen import VarlenBackend
    from pipeline.layers.attention.varlen_packed import PackedVarlenBackend, triton_paged_decode

    kernel = kernel or installed_varlen_attn()
    kind = entry_kind(kernel)
    if kind == PAGED:
        return VarlenBackend(kernel)
    if kind == PACKED:
        return PackedVarlenBackend(kernel, triton_paged_decode() if paged_decode else None)
    raise ValueError("the varlen attention backend needs torch.nn.attention.varlen.varlen_attn (torch >= 2.10); "
                     f"torch {torch.__version__} has {'none' if kernel is None else 'one of another signature'}: "
                     "use attention_backend 'cpu' or 'reference'")


def cuda_backend(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype,
                 heads: tuple[int, int, int] | None = None) -> AttentionBackend:
    """The fastest backend that runs correctly here (see the module docstring)."""
    from pipeline.layers.attention.cpu import CpuBackend

    if dtype not in (torch.float16, torch.bfloat16) or kv_dtype != dtype:
        kv = "an int8 KV cache" if kv_dtype == torch.int8 else str(kv_dtype).removeprefix("torch.")
        say_once(logging.WARNING, f"attention on CUDA in {str(dtype).removeprefix('torch.')} with {kv}: the PyTorch "
                                  "paths of the cpu backend, without FlashAttention (float16/bfloat16 with a cache "
                                  "of that dtype only) or CUDA graphs: slow")
        return CpuBackend()
    problem, paged_decode = _decide(device, dtype, heads or PROBE_HEADS)
    if problem is None:
        return varlen_backend(paged_decode=paged_decode)
    say_once(logging.WARNING, f"attention on this GPU: the PyTorch paths of the cpu backend, slow (no CUDA graphs): "
                              f"{problem}")
    return CpuBackend()


@functools.cache
def _decide(device: torch.device, dtype: torch.dtype, heads: tuple[int, int, int]) -> tuple[str | None, bool]:
    """(None when FlashAttention varlen serves here, else why not; whether a packed
    backend's decode steps take the Triton kernel). Once per process."""
    kernel = installed_varlen_attn()
    kind = entry_kind(kernel)
    if kind is None:
        return (f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn we can call "
                "(FlashAttention-2 varlen: torch >= 2.10)"), False
    if not flash_capable(device):
        major, minor = torch.cuda.get_device_capability(device)
        return f"FlashAttention-2 needs compute capability 8.0 (Ampere) or later, this GPU has {major}.{minor}", False
    if kind == PAGED:
        problem = probe(varlen_backend(kernel), device, dtype, heads)
        if problem is not None:
            return f"the paged varlen_attn of torch {torch.__version__} failed a probe: {problem}", False
        say_once(logging.INFO, f"attention: FlashAttention-2 varlen over the paged cache (torch {torch.__version__}'s "
                               "varlen_attn takes block_table)")
        return None, False
    gathered = (f"attention: FlashAttention-2 varlen over pages gathered each step (torch {torch.__version__}'s "
                "varlen_attn has no block_table; paged from torch 2.12)")
    backend = varlen_backend(kernel)
    problem = probe(backend, device, dtype, heads)
    if problem is None and backend.decode_kernel is not None:
        say_once(logging.INFO, f"{gathered} for steps with prefill chunks; decode-only steps read the pages in place "
                               "(Triton) and replay CUDA graphs")
        return None, True
    why_gathered = "Triton does not import"
    if problem is not None and backend.decode_kernel is not None:
        why_gathered = f"the Triton paged decode failed a probe: {problem}"
        problem = probe(varlen_backend(kernel, paged_decode=False), device, dtype, heads)
    if problem is not None:
        return f"the packed varlen_attn of torch {torch.__version__} failed a probe: {problem}", False
    say_once(logging.WARNING, f"{gathered}, decode steps too ({why_gathered}): no CUDA graphs, slower decode")
    return None, False


def flash_capable(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 0)


def probe(backend: AttentionBackend, device: torch.device, dtype: torch.dtype,
          heads: tuple[int, int, int] = PROBE_HEADS) -> str | None:
    """None when backend's forward equals ReferenceVarlenBackend's on the probe batches, else what went wrong."""
    from pipeline.layers.attention.varlen import ReferenceVarlenBackend

    try:
        for layout in probe_layouts(backend.default_block_size):
            cache, q = probe_inputs(layout, device, dtype, heads)
            reference = ReferenceVarlenBackend()
            scale = heads[2] ** -0.5
            to_device = HostToDevice(device)
            want = reference.forward(q, None, None, cache, reference.build_metadata(layout, heads[1], to_device), scale)
            got = backend.forward(q, None, None, cache, backend.build_metadata(layout, heads[1], to_device), scale)
            error = (got.float() - want.float()).abs() - 2e-2 * want.float().abs()
            if got.shape != want.shape or not bool((error <= 5e-2).all()):
                return f"max_q {int(layout.query_lens.max())}: off by {error.max().item():.3g} from the reference"
    except Exception as e:   # no kernel for this GPU or dtype, a signature we misread, ...
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def probe_layouts(block_size: int) -> list[StepLayout]:
    """A mixed step (a decode of 5 keys on page 1; a chunk of 3 rows whose keys fill page 2
    and go on into page 0) and a decode-only step (two decodes), over 3 pages and the pad page 3."""
    pad = 3

    def layout(query_lens, context_lens, tables, num_decode):
        q_lens, c_lens = np.array(query_lens, np.int32), np.array(context_lens, np.int32)
        tables = np.array(tables, np.int32)
        owner = np.repeat(np.arange(len(q_lens)), q_lens)
        positions = np.concatenate([np.arange(c - q, c) for q, c in zip(q_lens, c_lens)]).astype(np.int64)
        slots = tables[owner, positions // block_size].astype(np.int64) * block_size + positions % block_size
        return StepLayout(input_ids=np.zeros(len(positions), np.int64), positions=positions, slot_mapping=slots,
                          query_lens=q_lens, context_lens=c_lens, block_tables=tables, num_decode_seqs=num_decode,
                          sample_rows=np.zeros(0, np.int64), block_size=block_size, pad_block=pad)

    chunk_keys = block_size + min(44, block_size - 1)   # into its second page, not past it
    return [layout([1, 3], [5, chunk_keys], [[1, pad], [2, 0]], 1),
            layout([1, 1], [5, chunk_keys], [[1, pad], [2, 0]], 2)]


def probe_inputs(layout: StepLayout, device: torch.device, dtype: torch.dtype,
                 heads: tuple[int, int, int]) -> tuple[LayerCache, torch.Tensor]:
    """Random keys, values and queries, but every key that some row must not see (past a
    sequence's length, on the pad page, or one of the step's new keys, which only the causal
    mask hides from the rows before it) has key 0 and value HIDDEN: with q.k of unit spread,
    each such key a row wrongly sees moves its output by about HIDDEN / 500."""
    num_heads, num_kv_heads, head_dim = heads
    bs = layout.block_size
    gen = torch.Generator().manual_seed(0)
    shape = (layout.pad_block + 1, bs, num_kv_heads, head_dim)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    plain = torch.zeros(shape[:2], dtype=torch.bool)   # keys every row of their sequence sees
    for table, length, new in zip(layout.block_tables, layout.context_lens, layout.query_lens):
        for position in range(int(length - new)):
            plain[int(table[position // bs]), position % bs] = True
    k[~plain], v[~plain] = 0.0, HIDDEN
    q = torch.randn(len(layout.input_ids), num_heads, head_dim, generator=gen)
    return LayerCache(k.to(device, dtype), v.to(device, dtype)), q.to(device, dtype)
