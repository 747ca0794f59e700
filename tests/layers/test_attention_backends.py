"""Attention backends (pipeline/layers/attention) and CUDA-graph decode (pipeline/cuda_graphs).

The varlen metadata of a hand-made mixed batch against values worked out by hand; the
plain-PyTorch varlen reference against the cpu backend (C kernels) on that batch; whole
engines on the two backends giving the same greedy tokens through chunked prefill, prefix
caching and speculative rows; and the padded decode forward a CUDA graph would capture
traced whole by torch.compile(fullgraph=True) on the CPU, equal to eager for real and
padding rows, writing nothing outside the real slots and the pad block.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from attention_helpers import BS, CPU, NUM_BLOCKS, hand_made_batch, next_decode_layout, runner_for, seq
from pipeline import Engine, EngineConfig, Request, SamplingParams
from pipeline.kernels import cpu_kernels
from pipeline.layers.attention import HostToDevice, LayerCache, select
from pipeline.layers.attention.cpu import CpuBackend
from pipeline.layers.attention.varlen import ReferenceVarlenBackend, VarlenBackend
from pipeline.engine.block_table_rows import BlockTableRows
from pipeline.engine.cuda_graphs import DecodeGraphs, buckets, capture_decode_graphs

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # see conftest


def test_varlen_metadata_of_a_mixed_batch_matches_hand_computed_values():
    runner, kv = runner_for(ReferenceVarlenBackend())
    layout = runner._prepare(*hand_made_batch())
    meta = runner.backend.build_metadata(layout, kv.num_kv_heads, runner.to_device)
    assert kv.pad_block == NUM_BLOCKS and kv.k.shape[1] == NUM_BLOCKS + 1   # one block no sequence owns
    assert meta.cu_seq_q.tolist() == [0, 1, 4, 9, 12]
    assert meta.seqused_k.tolist() == [5, 9, 5, 11]
    assert meta.cu_seq_k.tolist() == [0, 5, 14, 19, 30]
    assert (meta.max_q, meta.max_k) == (5, 11)
    pad = NUM_BLOCKS   # only the blocks reached this step; the rest is the pad block
    assert meta.block_table.tolist() == [[7, 3, pad], [1, 9, 2], [4, 5, pad], [6, 0, 8]]
    assert meta.block_table.dtype == meta.cu_seq_q.dtype == meta.seqused_k.dtype == torch.int32
    positions = [4, 6, 7, 8, 0, 1, 2, 3, 4, 8, 9, 10]
    owners = [[7, 3], [1, 9, 2], [1, 9, 2], [1, 9, 2], *[[4, 5]] * 5, *[[6, 0, 8]] * 3]
    assert layout.positions.tolist() == positions
    assert meta.slot_mapping.tolist() == [t[p // BS] * BS + p % BS for t, p in zip(owners, positions)]
    assert layout.input_ids.tolist() == [104, 106, 55, 56, 100, 101, 102, 103, 104, 108, 109, 110]
    # Rows that sample: the decode, all 1 + 2 speculative rows, the fresh prompt's last; not the chunk.
    assert layout.sample_rows.tolist() == [0, 1, 2, 3, 8]
    assert layout.num_decode_seqs == 2 and not layout.is_plain_decode
    assert runner.to_device.pinned == {}   # a CPU never stages through pinned memory


def test_block_tables_from_the_block_managers_rows_equal_those_from_the_lists():
    """An engine's runner gathers the step's tables from BlockTableRows; stale entries past a
    table's end (a truncated or regrown table's) never show."""
    by_lists, _ = runner_for(ReferenceVarlenBackend())
    by_rows, _ = runner_for(ReferenceVarlenBackend())
    by_rows.table_rows = rows = BlockTableRows(rows=2, width=2)   # grows on the way
    seqs, num_new = hand_made_batch()
    for s in reversed(seqs):
        table = s.block_table
        s.block_table = table + [NUM_BLOCKS - 1] * 3   # stale entries, as a truncated table leaves
        rows.write(s)
        s.block_table = table
    expected, got = by_lists._prepare(seqs, num_new), by_rows._prepare(seqs, num_new)
    for field in ("input_ids", "positions", "slot_mapping", "query_lens", "context_lens", "block_tables",
                  "sample_rows"):
        assert np.array_equal(getattr(got, field), getattr(expected, field)), field
    assert got.block_tables.dtype == np.int32
    assert sorted(s.table_row for s in seqs) == [0, 1, 2, 3] and rows.array.shape[1] >= 8


def test_cpu_metadata_of_the_same_batch_splits_speculative_rows_into_decodes():
    runner, kv = runner_for(CpuBackend())
    layout = runner._prepare(*hand_made_batch())
    meta = runner.backend.build_metadata(layout, kv.num_kv_heads, runner.to_device)
    assert meta.decode.context_lens.tolist() == [5, 7, 8, 9]
    assert meta.decode.block_tables.tolist()[1:] == [[1, 9, 2]] * 3
    assert [(c.start, c.end, c.block_ids is None) for c in meta.prefills] == [(4, 9, True), (9, 12, False)]
    assert meta.prefills[1].block_ids.tolist() == [6, 0, 8] and meta.prefills[1].mask.shape == (3, 11)
    # cache rows: the layer viewed as [blocks * kv_heads * bs, head_dim], each token's 2 heads;
    # the decode's token is at block 3, offset 0, the fresh prompt's first at block 4, offset 0.
    assert meta.cache_rows[:2].tolist() == [(3 * 2 + h) * BS + 0 for h in range(2)]
    assert meta.cache_rows[8:10].tolist() == [(4 * 2 + h) * BS + 0 for h in range(2)]


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(4, 2, 16), (4, 4, 8), (6, 2, 32)])
def test_reference_backend_equals_the_cpu_backend_on_a_mixed_batch(num_heads, num_kv_heads, head_dim):
    """Decodes, speculative rows, a fresh prefill and a chunk over a cached prefix, GQA,
    float32: the same attention output, with the cached context in each backend's layout."""
    gen = torch.Generator().manual_seed(0)
    # Logical content of every block: [blocks + pad, bs, kv_heads, head_dim].
    k_content = torch.randn(NUM_BLOCKS + 1, BS, num_kv_heads, head_dim, generator=gen)
    v_content = torch.randn(NUM_BLOCKS + 1, BS, num_kv_heads, head_dim, generator=gen)
    tokens = 12
    q = torch.randn(tokens, num_heads, head_dim, generator=gen)
    k_new = torch.randn(tokens, num_kv_heads, head_dim, generator=gen)
    v_new = torch.randn(tokens, num_kv_heads, head_dim, generator=gen)
    outs = {}
    for backend, to_layout in ((CpuBackend(), lambda c: c.transpose(1, 2).contiguous()),
                               (ReferenceVarlenBackend(), lambda c: c.clone())):
        runner, kv = runner_for(backend, num_kv_heads, head_dim)
        cache = LayerCache(to_layout(k_content), to_layout(v_content))
        layout = runner._prepare(*hand_made_batch())
        meta = backend.build_metadata(layout, num_kv_heads, runner.to_device)
        backend.write_kv(cache, k_new, v_new, meta)
        outs[backend.name] = backend.forward(q, k_new, v_new, cache, meta, head_dim ** -0.5)
    assert cpu_kernels.can_run_paged_decode_attention(q, torch.empty(1, dtype=torch.float32))   # the C kernel ran
    torch.testing.assert_close(outs["reference"], outs["cpu"], atol=1e-5, rtol=1e-5)


def test_reference_decode_ignores_keys_past_seqused_k():
    """A row sees exactly seqused_k keys: garbage after them in the same page changes nothing."""
    backend = ReferenceVarlenBackend()
    runner, kv = runner_for(backend)
    layout = runner._prepare([seq("a", 6, 5, [2, 5])], [1])
    meta = backend.build_metadata(layout, 2, runner.to_device)
    gen = torch.Generator().manual_seed(1)
    cache = LayerCache(torch.randn(kv.k[0].shape, generator=gen), torch.randn(kv.v[0].shape, generator=gen))
    q = torch.randn(1, 4, 16, generator=gen)
    before = backend.forward(q, None, None, cache, meta, 0.25)
    cache.k[5, 2:], cache.v[5, 2:] = 1e4, -1e4    # positions 6, 7: past the 6 keys
    torch.testing.assert_close(backend.forward(q, None, None, cache, meta, 0.25), before)
    cache.k[5, 1] = 1e4                           # position 5: inside
    assert not torch.allclose(backend.forward(q, None, None, cache, meta, 0.25), before)


def repetitive(rng: random.Random, n: int) -> list[int]:
    pattern = [rng.randrange(100, 49000) for _ in range(rng.randint(3, 9))]
    tokens = [rng.randrange(100, 49000) for _ in range(rng.randint(0, 10))]
    while len(tokens) < n:
        tokens += pattern
    return tokens[:n]


def test_engines_on_the_cpu_and_reference_backends_decode_the_same_tokens(tiny_model_dir):
    """Chunked prefill (a 32-token budget), prefix caching (a shared 40-token prefix) and
    speculative 1 + K rows: every step shape, through both backends' metadata."""
    rng = random.Random(3)
    prefix = repetitive(rng, 40)
    requests = [Request(f"r{i}", prompt_token_ids=prefix + repetitive(rng, rng.randint(1, 70)),
                        params=SamplingParams(temperature=0.0, max_tokens=rng.randint(8, 24), ignore_eos=True))
                for i in range(12)]
    results = {}
    for name in ("cpu", "reference"):
        engine = Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), num_kv_blocks=256, block_size=8,
                                     max_num_batched_tokens=32, max_num_seqs=12, speculative="ngram",
                                     num_speculative_tokens=3, attention_backend=name,
                                     batch_invariant=False))   # the mode is the cpu backend's alone
        assert engine.attention_backend.name == name
        outs = {o.id: o for o in engine.generate(requests)}
        assert all(o.error is None for o in outs.values())
        results[name] = outs
    cpu, ref = results["cpu"], results["reference"]
    assert {k: o.token_ids for k, o in ref.items()} == {k: o.token_ids for k, o in cpu.items()}
    assert sum(o.cached_tokens for o in ref.values()) > 0       # chunks after a cached prefix ran
    assert sum(o.draft_tokens for o in ref.values()) > 0        # so did speculative rows


def test_varlen_refuses_what_flash_attention_cannot_run():
    cuda = torch.device("cuda")   # a device object only: nothing runs on it
    with pytest.raises(ValueError, match="divisible by 256"):
        VarlenBackend().check(16, torch.bfloat16, torch.bfloat16, cuda)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        VarlenBackend().check(256, torch.float32, torch.float32, cuda)
    with pytest.raises(ValueError, match="int8"):
        ReferenceVarlenBackend().check(16, torch.float32, torch.int8, CPU)
    VarlenBackend().check(512, torch.bfloat16, torch.bfloat16, cuda)
    assert select("auto", CPU, torch.bfloat16, torch.bfloat16).name == "cpu"   # on CUDA: test_flash_entry.py
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="flash")


def test_a_failed_capture_leaves_the_engine_eager_and_says_so(tiny_model_dir, monkeypatch, caplog):
    engine = Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), num_kv_blocks=16, block_size=8,
                                 max_num_seqs=4, attention_backend="reference",
                                 batch_invariant=False))

    def capture(self):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")
    monkeypatch.setattr(DecodeGraphs, "capture", capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    assert capture_decode_graphs(engine.model, 4, 64, 8, engine.runner.kv_cache.pad_block, CPU) is None
    assert [r.getMessage() for r in caplog.records] == [
        "CUDA graphs could not be captured, every step runs eagerly (slower): operation not permitted when "
        "stream is capturing"]


def test_buckets_cover_every_batch_size():
    assert buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert buckets(3) == [1, 2, 3]
    assert buckets(1) == [1]
    assert buckets(20) == [1, 2, 4, 8, 16, 20]


def test_padded_decode_forward_has_no_graph_break_and_equals_eager(tiny_model_dir, monkeypatch, host_reads):
    """What a CUDA graph captures, traced whole on the CPU (PyTorch paths: no C kernels, no
    packed weights): torch.compile(fullgraph=True) raises on any graph break. It does not
    catch a host read (torch 2.13 traces .item() into the graph as an unbacked scalar), so
    the eager padded forward must also read nothing back. 3 sequences padded to the bucket
    of 4: compiled logits equal eager's for the real and the padding row, the real rows
    equal the unpadded eager step's, and the padding row wrote only to the pad block."""
    monkeypatch.setattr(cpu_kernels, "_load", lambda: None)   # as PIPELINE_CPU_KERNELS=0
    engine = Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), num_kv_blocks=64, block_size=8,
                                 max_num_seqs=4, pack_weights=False, attention_backend="reference",
                                 batch_invariant=False))
    rng = random.Random(0)
    assert engine.runner.graphs is None   # cuda_graphs is on by default, and ignored on a CPU
    batch, layout = next_decode_layout(engine, [
        Request(f"g{i}", prompt_token_ids=[rng.randrange(100, 49000) for _ in range(n)],
                params=SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        for i, n in enumerate((5, 19, 33))])
    runner = engine.runner
    kv = runner.kv_cache
    graphs = DecodeGraphs(engine.model, 4, engine.max_model_len, engine.block_size, kv.pad_block, CPU)
    with torch.inference_mode():
        unpadded = engine.model.compute_logits(runner.forward(layout))
        bucket = graphs.load(layout, HostToDevice(CPU))
        assert bucket == 4
        k_before = kv.k.clone()
        reads = sum(host_reads.values())
        eager = engine.model.compute_logits(graphs.forward(bucket))
        assert sum(host_reads.values()) == reads, host_reads   # nothing a capture would choke on
        compiled = engine.model.compute_logits(
            torch.compile(graphs.forward, fullgraph=True, backend="eager", dynamic=False)(bucket))
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)   # all 4 rows, the padding one too
    torch.testing.assert_close(eager[:3], unpadded, atol=1e-4, rtol=1e-4)
    changed = (kv.k != k_before).flatten(3).any(-1).any(0)              # [blocks + pad, bs]
    real = {(int(s) // engine.block_size, int(s) % engine.block_size) for s in layout.slot_mapping}
    stray = {(b, o) for b, o in changed.nonzero().tolist() if (b, o) not in real and b != kv.pad_block}
    assert not stray
    assert changed[kv.pad_block].any()   # the padding row wrote its keys to the pad block
    engine.abort([s.request_id for s in batch.seqs])
