"""The Triton paged decode kernel (pipeline/kernels/paged_decode_triton.py) and the packed
varlen backend's decode steps through it (varlen_packed.py), on the CPU under Triton's
interpreter (conftest sets TRITON_INTERPRET=1 where there is no GPU).

The interpreter computes bfloat16 matrix products wrongly (it reads the raw bits), so the
kernel is checked in float32 and float16 here; bfloat16 is what the start-up probe and
gpu_check.py check on a GPU. A whole engine on the packed backend (torch 2.11's call in
PyTorch for its prefill steps, the kernel for its decode steps) decodes the reference
backend's tokens, and the padded decode forward a CUDA graph captures equals the unpadded one.
"""
from __future__ import annotations

import random

import pytest
import torch

from attention_helpers import CPU, hand_made_batch, next_decode_layout, runner_for, seq, varlen_attn_2_11
from pipeline import Engine, EngineConfig, Request, SamplingParams
from pipeline.engine.cuda_graphs import DecodeGraphs
from pipeline.kernels.paged_decode_triton import MAX_SPLITS, num_splits, paged_decode_attention
from pipeline.layers.attention import HostToDevice, choice, varlen_packed
from pipeline.layers.attention.varlen import ReferenceVarlenBackend, VarlenMetadata
from pipeline.layers.attention.varlen_packed import PackedVarlenBackend

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # see conftest


def attention_by_hand(q, k_cache, v_cache, block_table, seqused_k, scale):
    """Each sequence's first seqused_k keys of its pages, every query head against its KV head, in float64."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[2]
    block_size = k_cache.shape[1]
    for i, n in enumerate(seqused_k.tolist()):
        pages = block_table[i, :-(-n // block_size)].long()
        k = k_cache[pages].flatten(0, 1)[:n].double().repeat_interleave(group, 1)
        v = v_cache[pages].flatten(0, 1)[:n].double().repeat_interleave(group, 1)
        scores = torch.einsum("hd,khd->hk", q[i].double(), k) * scale
        out[i] = torch.einsum("hk,khd->hd", scores.softmax(-1), v)
    return out


@pytest.mark.parametrize("dtype, heads, block_size, splits", [
    (torch.float32, (8, 2, 64), 16, 1),      # Llama-3.2-1B's group of 4
    (torch.float32, (6, 2, 80), 16, 3),      # a group of 3 and a head_dim of 80: both padded in the kernel
    (torch.float16, (32, 8, 64), 16, 4),
    (torch.float16, (4, 4, 32), 32, None),   # no grouping, other pages, splits chosen for the batch
])
def test_kernel_equals_attention_by_hand(dtype, heads, block_size, splits):
    """Lengths of 1 key, a page and one, several key blocks, exactly one key block; each
    sequence's pages in random order, none shared. Every key no sequence may see has a
    value of 1e3, so any read past seqused_k (or of a wrong page) shows."""
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(0)
    seqused_k = torch.tensor([1, block_size + 1, 170, 64, 5], dtype=torch.int32)
    pages = 12
    tables = torch.randperm(len(seqused_k) * pages + 4, generator=gen)[:len(seqused_k) * pages].view(-1, pages).int()
    shape = (len(seqused_k) * pages + 4, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.zeros(shape), torch.full(shape, 1e3)
    for table, n in zip(tables.tolist(), seqused_k.tolist()):
        for position in range(n):
            block, offset = table[position // block_size], position % block_size
            k_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=gen)
            v_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=gen)
    q = torch.randn(len(seqused_k), num_heads, head_dim, generator=gen)
    k_cache, v_cache, q = k_cache.to(dtype), v_cache.to(dtype), q.to(dtype)
    scale = head_dim ** -0.5
    got = paged_decode_attention(q, k_cache, v_cache, tables, seqused_k, scale, splits)
    want = attention_by_hand(q, k_cache, v_cache, tables, seqused_k, scale)
    assert got.dtype == dtype and got.shape == q.shape
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.double(), want, atol=tolerance, rtol=tolerance)


def test_splits_fill_the_gpu_only_when_the_batch_does_not():
    assert num_splits(256, 8, 132) == 1            # 2,048 programs for 132 SMs
    assert num_splits(16, 8, 132) == 8             # 128 programs: 4.1x short of 4 an SM, so 8 splits
    assert num_splits(48, 8, 132) == 2 and num_splits(80, 8, 132) == 1
    assert num_splits(1, 1, 132) == MAX_SPLITS
    assert num_splits(3, 2, 1) == 1                # the interpreter's one "SM"


def decode_layout(runner, lengths):
    """A decode-only step of sequences with these context lengths, on disjoint pages."""
    bs = runner.block_size
    seqs, first = [], 0
    for i, n in enumerate(lengths):
        pages = -(-n // bs)
        seqs.append(seq(f"d{i}", n, n - 1, list(range(first, first + pages))))
        first += pages
    return runner._prepare(seqs, [1] * len(seqs))


def test_packed_backend_reads_a_decode_steps_pages_in_place():
    """A decode-only step through the kernel (no key slots built, torch's varlen_attn not
    called) equals the reference backend; a step with a prefill chunk still gathers."""

    gen = torch.Generator().manual_seed(1)
    backend = PackedVarlenBackend(varlen_attn_2_11, paged_decode_attention)
    assert backend.supports_cuda_graphs and not PackedVarlenBackend(varlen_attn_2_11).supports_cuda_graphs
    runner, kv = runner_for(ReferenceVarlenBackend(), num_kv_heads=2, head_dim=16)
    cache = type(kv.layer(0))(torch.randn(kv.k[0].shape, generator=gen), torch.randn(kv.v[0].shape, generator=gen))
    varlen_attn_2_11.windows.clear()
    for layout in (decode_layout(runner, [5, 9, 1]), runner._prepare(*hand_made_batch())):
        q = torch.randn(len(layout.input_ids), 4, 16, generator=gen)
        want = runner.backend.forward(q, None, None, cache, runner.backend.build_metadata(layout, 2, runner.to_device),
                                      0.25)
        meta = backend.build_metadata(layout, 2, runner.to_device)
        assert (type(meta) is VarlenMetadata) == layout.is_plain_decode   # key slots only where it gathers
        torch.testing.assert_close(backend.forward(q, None, None, cache, meta, 0.25), want, atol=1e-5, rtol=1e-5)
    assert varlen_attn_2_11.windows == [(-1, 0)]   # only the mixed step called FlashAttention


def test_varlen_on_a_packed_torch_takes_the_kernel_where_triton_imports(monkeypatch):
    cuda = torch.device("cuda")   # a device object only: nothing runs on it
    monkeypatch.setattr(choice, "installed_varlen_attn", lambda: varlen_attn_2_11)
    backend = choice.varlen_backend()
    assert backend.decode_kernel is paged_decode_attention and backend.supports_cuda_graphs
    backend.check(16, torch.bfloat16, torch.bfloat16, cuda)
    with pytest.raises(ValueError, match="power-of-two block_size"):
        backend.check(24, torch.bfloat16, torch.bfloat16, cuda)
    assert not choice.varlen_backend(paged_decode=False).supports_cuda_graphs
    monkeypatch.setattr(varlen_packed, "triton_paged_decode", lambda: None)   # no Triton
    backend = choice.varlen_backend()
    assert backend.decode_kernel is None and not backend.supports_cuda_graphs
    backend.check(24, torch.bfloat16, torch.bfloat16, cuda)                   # any block size gathers


@pytest.fixture
def packed_engine_backend(monkeypatch):
    """attention_backend 'varlen' on the CPU as torch 2.11 would have it: its varlen_attn's
    math in PyTorch for steps that gather, the kernel (interpreted) for decode steps."""
    monkeypatch.setattr(choice, "installed_varlen_attn", lambda: varlen_attn_2_11)
    monkeypatch.setattr(varlen_packed, "check_flash", lambda dtype, device: None)


def repetitive_requests(n, max_tokens):
    rng = random.Random(5)
    prefix = [rng.randrange(100, 4000) for _ in range(24)]
    return [Request(f"r{i}", prompt_token_ids=prefix + [rng.randrange(100, 4000) for _ in range(rng.randint(1, 40))],
                    params=SamplingParams(temperature=0.0, max_tokens=rng.randint(4, max_tokens), ignore_eos=True))
            for i in range(n)]


@pytest.mark.parametrize("overlap_steps", [False, True], ids=["serial", "overlapped"])
def test_an_engine_on_the_packed_backend_decodes_the_reference_tokens(tiny_model_dir, packed_engine_backend,
                                                                      overlap_steps):
    """Chunked prefill (a 32-token budget) and a shared prefix from the prefix cache, so
    steps mix decodes and chunks (gathered) and decode alone (the kernel); serial steps,
    and overlapped ones as on CUDA (the decode rows' tokens filled in on the device)."""
    requests = repetitive_requests(6, 12)
    tokens, calls = {}, []
    for name in ("varlen", "reference"):
        engine = Engine(EngineConfig(device="cpu", dtype="float32", model=str(tiny_model_dir), num_kv_blocks=64,
                                     block_size=16, max_num_batched_tokens=32, max_num_seqs=6,
                                     attention_backend=name, overlap_steps=overlap_steps and name == "varlen",
                                     batch_invariant=False))   # the mode is the cpu backend's alone
        if name == "varlen":
            backend = engine.attention_backend
            assert backend.decode_kernel is paged_decode_attention

            def counted(q, *args):
                calls.append(len(q))
                return paged_decode_attention(q, *args)
            backend.decode_kernel = counted
        outs = engine.generate(requests)
        assert all(o.error is None for o in outs)
        tokens[name] = {o.id: o.token_ids for o in outs}
        if name == "varlen":
            overlapped = engine.num_overlapped_steps
    assert tokens["varlen"] == tokens["reference"]
    assert len(calls) >= 2 * 4 and max(calls) == 6   # both layers, steps of all six decoding
    assert (overlapped > 0) == overlap_steps


def test_the_padded_decode_forward_a_graph_captures_equals_the_unpadded_step(tiny_model_dir, packed_engine_backend):
    """3 decoding sequences padded to the bucket of 4 (the padding row one key on the pad
    block), over DecodeGraphs' buffers with max_k the model's context: the kernel's logits
    for the real rows equal the eager step's."""
    engine = Engine(EngineConfig(device="cpu", dtype="float32", model=str(tiny_model_dir), num_kv_blocks=32,
                                 block_size=16, max_num_seqs=4, attention_backend="varlen",
                                 batch_invariant=False))
    batch, layout = next_decode_layout(engine, repetitive_requests(3, 8))
    runner = engine.runner
    graphs = DecodeGraphs(engine.model, 4, engine.max_model_len, engine.block_size, runner.kv_cache.pad_block, CPU)
    with torch.inference_mode():
        unpadded = engine.model.compute_logits(runner.forward(layout))
        assert graphs.load(layout, HostToDevice(CPU)) == 4
        padded = engine.model.compute_logits(graphs.forward(4))
    torch.testing.assert_close(padded[:3], unpadded, atol=1e-4, rtol=1e-4)
    assert padded[3].isfinite().all()
    engine.abort([s.request_id for s in batch.seqs])
