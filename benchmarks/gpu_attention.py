"""gpu_check.py's lines for our Triton kernels: the paged decode kernel
(pipeline/kernels/paged_decode_triton.py) against the reference, and its speed against
what a decode step would otherwise run on this torch; and the fused elementwise kernels
(pointwise_triton.py) against PyTorch's ops (`check_pointwise_kernels`).

One Llama-3.2-1B-shaped layer's decode attention (32 query heads over 8 KV heads of 64) in
bf16, block size 16, each sequence's pages scattered over the pool: 256 sequences of 128 to
640 keys, then 16 sequences (where the kernel splits each sequence's keys). The line
reports each kernel's microseconds (median of CUDA-event timings of eager calls, launch
latency included, as the alternatives below are timed; `triton_graphed_us`: in a CUDA
graph, as a decode step runs it), the context's bytes read over that time as a share of
HBM_BYTES_S, and the alternatives':
- `gathered_us`: pages gathered into packed keys, then torch's packed varlen_attn (what a
  2.10/2.11 decode step runs without the kernel: varlen_packed.py);
- `paged_flash_us`: FlashAttention-2 reading the pages (torch >= 2.12 only, 256-key pages).
It passes when the kernel's output is within bf16 precision of the reference backend.
On a CPU (--quick) the kernel runs under Triton's interpreter at a small size and in
float16 (the interpreter's bf16 matrix products are wrong): the numerics are checked, the
times mean nothing.
"""
from __future__ import annotations

import torch

from gpu_quant import graphed_us, timed
from gpu_report import report
from gpu_speed import HBM_BYTES_S
from pipeline.layers.attention import LayerCache
from pipeline.layers.attention.flash_entry import PACKED, PAGED, entry_kind, installed_varlen_attn
from pipeline.layers.attention.varlen import ReferenceVarlenBackend, VarlenBackend, VarlenMetadata

HEADS = (32, 8, 64)   # Llama-3.2-1B's query heads, KV heads, head_dim
BOUND = 2e-2          # max |error| against the float32 reference, bf16 outputs of unit scale


def decode_step(num_seqs: int, block_size: int, device: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """A decode step's query, its layer cache (pages in random order) and its varlen metadata."""
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads, head_dim = HEADS
    lengths = torch.randint(128, 641, (num_seqs,), generator=gen, dtype=torch.int32)
    pages = -(-lengths // block_size)
    width = int(pages.max())
    order = torch.randperm(int(pages.sum()) + 1, generator=gen)
    table = torch.full((num_seqs, width), int(order[-1]), dtype=torch.int32)   # padded with a spare page
    first = 0
    for i, n in enumerate(pages.tolist()):
        table[i, :n] = order[first:first + n]
        first += n
    shape = (len(order), block_size, num_kv_heads, head_dim)
    cache = LayerCache(torch.randn(shape, generator=gen).to(device, dtype),
                       torch.randn(shape, generator=gen).to(device, dtype))
    q = torch.randn(num_seqs, num_heads, head_dim, generator=gen).to(device, dtype)
    cu_k = torch.zeros(num_seqs + 1, dtype=torch.int32)
    torch.cumsum(lengths, 0, out=cu_k[1:])
    meta = VarlenMetadata(slot_mapping=torch.zeros(num_seqs, dtype=torch.int64, device=device),
                          cu_seq_q=torch.arange(num_seqs + 1, dtype=torch.int32, device=device),
                          cu_seq_k=cu_k.to(device), seqused_k=lengths.to(device), block_table=table.to(device),
                          max_q=1, max_k=int(lengths.max()))
    return q, cache, meta


def check_decode_kernel(run) -> None:
    from pipeline.kernels.paged_decode_triton import paged_decode_attention
    from pipeline.layers.attention.varlen_packed import PackedVarlenBackend, with_key_slots

    device = run.device
    sizes, iters, dtype = ((256, 16), 20, torch.bfloat16) if device == "cuda" else ((8,), 1, torch.float16)
    scale = HEADS[2] ** -0.5
    kind = entry_kind(installed_varlen_attn())
    fields, errors = {}, []
    for num_seqs in sizes:
        q, cache, meta = decode_step(num_seqs, 16, device, dtype)
        want = ReferenceVarlenBackend().forward(q.float(), None, None, LayerCache(cache.k.float(), cache.v.float()),
                                                meta, scale)
        got = paged_decode_attention(q, cache.k, cache.v, meta.block_table, meta.seqused_k, scale)
        errors.append((got.float() - want).abs().max().item())
        kv_bytes = 2 * int(meta.seqused_k.sum()) * HEADS[1] * HEADS[2] * cache.k.element_size()
        def triton():
            return paged_decode_attention(q, cache.k, cache.v, meta.block_table, meta.seqused_k, scale)
        row = dict(triton_us=round(timed(triton, device, iters), 1))
        row["triton_hbm_share"] = round(kv_bytes / (row["triton_us"] * 1e-6) / HBM_BYTES_S, 3)
        if device == "cuda":   # as a decode step runs it: in a CUDA graph, no launch latency
            row["triton_graphed_us"] = round(graphed_us(triton, device), 1)
            row["triton_graphed_hbm_share"] = round(kv_bytes / (row["triton_graphed_us"] * 1e-6) / HBM_BYTES_S, 3)
        if device == "cuda" and kind == PACKED:
            gathering = PackedVarlenBackend()
            layout_meta = with_key_slots(meta, int(meta.seqused_k.sum()), 16)
            row["gathered_us"] = round(timed(lambda: gathering.forward(q, None, None, cache, layout_meta, scale),
                                             device, iters), 1)
            row["gathered_over_triton"] = round(row["gathered_us"] / row["triton_us"], 2)
        if device == "cuda" and kind == PAGED:
            q2, pages, meta2 = decode_step(num_seqs, 256, device)
            paged = VarlenBackend()
            row["paged_flash_us"] = round(timed(lambda: paged.forward(q2, None, None, pages, meta2, scale),
                                                device, iters), 1)
        fields[f"seqs_{num_seqs}"] = row
    ok = max(errors) <= BOUND
    report("paged_decode_kernel", "passed" if ok else "failed", varlen_attn_entry=kind, heads=list(HEADS),
           dtype=str(dtype).removeprefix("torch."), block_size=16, max_abs_error=round(max(errors), 5), bound=BOUND,
           **fields)


def check_pointwise_kernels(run) -> None:
    """A Llama-3.2-1B-shaped layer's elementwise work at 256 decode rows, 16 layers' worth:
    PyTorch's ops (what runs without the fused kernels) against pointwise_triton's, each
    captured in one CUDA graph and replayed (the decode steps' case), microseconds per layer."""
    from pipeline.kernels import pointwise_triton as fused
    from pipeline.layers.attention.varlen import ReferenceVarlenBackend, VarlenMetadata
    from pipeline.models.llama import Rotation, apply_rotary

    device = run.device
    rows, hidden, inter, layers = (256, 2048, 8192, 16) if device == "cuda" else (8, 64, 128, 2)
    num_heads, num_kv_heads, head_dim = HEADS if device == "cuda" else (4, 2, 16)
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)
    x, residual, weight = rand(rows, hidden), rand(rows, hidden), rand(hidden)
    gate_up = rand(rows, 2 * inter)
    qkv = rand(rows, (num_heads + 2 * num_kv_heads) * head_dim)
    angles = torch.randn(rows, head_dim // 2, generator=gen).to(device)
    rotation = Rotation(angles.cos(), angles.sin())
    cache = LayerCache(torch.zeros(rows // 16 + 1, 16, num_kv_heads, head_dim, dtype=dtype, device=device),
                       torch.zeros(rows // 16 + 1, 16, num_kv_heads, head_dim, dtype=dtype, device=device))
    meta = VarlenMetadata(slot_mapping=torch.randperm(rows, generator=gen).to(device), cu_seq_q=None, cu_seq_k=None,
                          seqused_k=None, block_table=None, max_q=1, max_k=1)
    reference = ReferenceVarlenBackend()
    q_end, k_end = num_heads, num_heads + num_kv_heads

    def pytorch_layer():
        for _ in range(2):
            total = residual + x
            torch.nn.functional.rms_norm(total, (hidden,), weight, 1e-5)
        heads = qkv.view(rows, -1, head_dim)
        qk = apply_rotary(heads[:, :k_end], rotation.complex)
        reference.write_kv(cache, qk[:, q_end:], heads[:, k_end:], meta)
        gate, up = gate_up.split(inter, dim=-1)
        torch.nn.functional.silu(gate).mul_(up)

    def fused_layer():
        for _ in range(2):
            fused.add_rms_norm(x, residual, weight, 1e-5)
        fused.rotary_write_kv(qkv, rotation.cos, rotation.sin, meta.slot_mapping, cache.k, cache.v, num_heads,
                              num_kv_heads)
        fused.silu_and_mul(gate_up)

    problem = fused.probe(torch.device(device), dtype)
    fields = dict(rows=rows, hidden=hidden, intermediate=inter, dtype=str(dtype).removeprefix("torch."),
                  probe=problem)
    for name, layer in (("pytorch", pytorch_layer), ("fused", fused_layer)):
        if device == "cuda":
            graph = _captured(lambda: [layer() for _ in range(layers)])
            fields[f"{name}_us_per_layer"] = round(timed(graph.replay, device, 20) / layers, 2)
        else:
            fields[f"{name}_us_per_layer"] = round(timed(layer, device, 1), 1)
    if device == "cuda":
        fields["speedup"] = round(fields["pytorch_us_per_layer"] / fields["fused_us_per_layer"], 2)
    report("pointwise_kernels", "passed" if problem is None else "failed", **fields)


def _captured(fn):
    """fn captured in a CUDA graph (after a warm-up run, as the engine's decode graphs are)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph
