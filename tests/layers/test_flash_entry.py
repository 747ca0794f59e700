"""Which FlashAttention varlen entry torch offers (flash_entry.py), the backend chosen for it
on CUDA (choice.py), and the packed backend torch 2.10/2.11 get (varlen_packed.py).

Nothing here needs a GPU: the two signatures are plain-PyTorch stand-ins (attention_helpers),
the installed torch's real varlen_attn is classified and called on meta tensors (a change of
its signature fails here), and the start-up probe runs on the CPU with the stand-ins.
"""
from __future__ import annotations

import inspect
import logging

import pytest
import torch

from attention_helpers import (BS, CPU, hand_made_batch, runner_for, top_left_varlen_attn, varlen_attn_2_11,
                               varlen_attn_2_12)
from pipeline.layers.attention import LayerCache, choice, select
from pipeline.layers.attention.cpu import CpuBackend
from pipeline.layers.attention.flash_entry import PACKED, PAGED, causal_window, entry_kind, installed_varlen_attn
from pipeline.layers.attention.varlen import ReferenceVarlenBackend, VarlenBackend, VarlenMetadata
from pipeline.layers.attention.varlen_packed import PackedVarlenBackend, PackedVarlenMetadata

CUDA = torch.device("cuda")   # a device object only: nothing runs on it
META = torch.device("meta")


def varlen_attn_main(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                     window_size=(-1, -1), k_cache=None, v_cache=None, cache_seqlens=None, cache_batch_idx=None,
                     page_table=None, seqused_k=None):
    """A development branch's shape (page_table, no block_table or enable_gqa): packed for us."""


@pytest.fixture(autouse=True)
def fresh_choice():
    choice._decide.cache_clear()
    choice.say_once.cache_clear()
    yield
    choice._decide.cache_clear()
    choice.say_once.cache_clear()


def test_entry_kind_reads_each_torch_signature():
    assert entry_kind(varlen_attn_2_11) == PACKED
    assert entry_kind(varlen_attn_2_12) == PAGED
    assert entry_kind(varlen_attn_main) == PACKED
    assert entry_kind(None) is None
    assert entry_kind(lambda *args, **kwargs: None) is None   # nothing we know how to name
    assert entry_kind(len) is None
    assert causal_window(1) == (-1, -1) and causal_window(2) == (-1, 0)


def test_the_installed_torch_has_the_entry_its_version_says():
    version = torch.torch_version.TorchVersion(torch.__version__.split("+")[0])
    expected = PAGED if version >= "2.12" else PACKED if version >= "2.10" else None
    assert entry_kind(installed_varlen_attn()) == expected


def meta_metadata(cls, **extra):
    def ints(*shape):
        return torch.empty(shape, dtype=torch.int32, device=META)
    return cls(slot_mapping=torch.empty(5, dtype=torch.int64, device=META), cu_seq_q=ints(3), cu_seq_k=ints(3),
               seqused_k=ints(2), block_table=ints(2, 2), max_q=4, max_k=300, **extra)


def test_the_installed_varlen_attn_takes_our_calls_on_meta_tensors():
    """Our backends' own forward calls into the real function (its fake kernel on meta
    tensors): a renamed or removed argument raises here."""
    kernel = installed_varlen_attn()
    if entry_kind(kernel) is None:
        pytest.skip(f"torch {torch.__version__} has no varlen_attn")
    q = torch.empty(5, 8, 64, dtype=torch.bfloat16, device=META)
    pages = LayerCache(*(torch.empty(3, 256, 2, 64, dtype=torch.bfloat16, device=META) for _ in range(2)))
    packed = PackedVarlenBackend().forward(q, None, None, pages, meta_metadata(
        PackedVarlenMetadata, key_slots=torch.empty(301, dtype=torch.int64, device=META)), 0.125)
    assert packed.shape == q.shape
    if entry_kind(kernel) == PAGED:
        assert VarlenBackend().forward(q, None, None, pages, meta_metadata(VarlenMetadata), 0.125).shape == q.shape


def test_varlen_follows_the_signature(monkeypatch):
    monkeypatch.setattr(choice, "installed_varlen_attn", lambda: varlen_attn_2_12)
    assert type(select("varlen", CUDA, torch.bfloat16, torch.bfloat16)) is VarlenBackend
    monkeypatch.setattr(choice, "installed_varlen_attn", lambda: varlen_attn_2_11)
    backend = select("varlen", CUDA, torch.bfloat16, torch.bfloat16)
    assert type(backend) is PackedVarlenBackend and backend.kernel is varlen_attn_2_11
    assert backend.decode_kernel is not None and backend.default_block_size == 16   # Triton: test_paged_decode_triton
    backend.check(16, torch.bfloat16, torch.bfloat16, CUDA)                     # no page constraint
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        backend.check(16, torch.float32, torch.float32, CUDA)
    monkeypatch.setattr(choice, "installed_varlen_attn", lambda: None)
    with pytest.raises(ValueError, match="torch >= 2.10"):
        select("varlen", CUDA, torch.bfloat16, torch.bfloat16)


def messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "pipeline.layers.attention"]


@pytest.mark.parametrize("kernel, capable, expected, said", [
    (varlen_attn_2_12, True, VarlenBackend, "over the paged cache"),
    (varlen_attn_2_11, True, PackedVarlenBackend, "gathered each step (torch"),
    (top_left_varlen_attn, True, CpuBackend, "failed a probe: max_q 3: off by"),
    (varlen_attn_2_11, False, CpuBackend, "compute capability 8.0 (Ampere) or later, this GPU has 7.5"),
    (None, True, CpuBackend, "has no torch.nn.attention.varlen.varlen_attn"),
])
def test_auto_on_cuda_takes_what_torch_and_the_gpu_serve(monkeypatch, caplog, kernel, capable, expected, said):
    """The choice chain on a CPU: the probe runs there with the stand-in kernels (the paged
    one only on the paged backend's 256-token pages). Said once, whatever the engines."""
    monkeypatch.setattr(choice, "installed_varlen_attn", lambda: kernel)
    monkeypatch.setattr(choice, "flash_capable", lambda device: capable)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    caplog.set_level(logging.INFO, "pipeline.layers.attention")
    for _ in range(2):
        backend = choice.cuda_backend(CPU, torch.float16, torch.float16, (4, 2, 16))
        assert type(backend) is expected
    said_lines = messages(caplog)
    assert len(said_lines) == 1 and said in said_lines[0], said_lines


def wrong_decode(q, k_cache, v_cache, block_table, seqused_k, scale):
    return torch.zeros_like(q)


@pytest.mark.parametrize("decode_kernel, graphs, said", [
    ("installed", True, "for steps with prefill chunks; decode-only steps read the pages in place (Triton) and "
                        "replay CUDA graphs"),
    (None, False, "decode steps too (Triton does not import): no CUDA graphs"),
    (wrong_decode, False, "decode steps too (the Triton paged decode failed a probe: max_q 1: off by"),
])
def test_a_packed_torch_reads_decode_pages_with_triton_where_it_passes_the_probe(monkeypatch, caplog, decode_kernel,
                                                                                  graphs, said):
    from pipeline.layers.attention import varlen_packed
    if decode_kernel != "installed":
        monkeypatch.setattr(varlen_packed, "triton_paged_decode", lambda: decode_kernel)
    monkeypatch.setattr(choice, "installed_varlen_attn", lambda: varlen_attn_2_11)
    monkeypatch.setattr(choice, "flash_capable", lambda device: True)
    caplog.set_level(logging.INFO, "pipeline.layers.attention")
    backend = choice.cuda_backend(CPU, torch.float16, torch.float16, (4, 2, 16))
    assert type(backend) is PackedVarlenBackend and backend.supports_cuda_graphs == graphs
    assert len(messages(caplog)) == 1 and said in messages(caplog)[0], messages(caplog)


def test_a_kernel_that_raises_falls_back(monkeypatch, caplog):
    def no_kernel(*args, **kwargs):
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")
    no_kernel.__signature__ = inspect.signature(varlen_attn_2_11)
    monkeypatch.setattr(choice, "installed_varlen_attn", lambda: no_kernel)
    monkeypatch.setattr(choice, "flash_capable", lambda device: True)
    assert type(choice.cuda_backend(CPU, torch.bfloat16, torch.bfloat16)) is CpuBackend
    assert "RuntimeError: FlashAttention only supports Ampere" in messages(caplog)[0]


@pytest.mark.parametrize("dtype, kv_dtype, said", [(torch.float32, torch.float32, "CUDA in float32 with float32"),
                                                   (torch.bfloat16, torch.int8, "an int8 KV cache")])
def test_what_flash_attention_never_takes_uses_the_pytorch_paths(caplog, dtype, kv_dtype, said):
    assert type(select("auto", CUDA, dtype, kv_dtype)) is CpuBackend
    assert type(select("auto", CUDA, dtype, kv_dtype)) is CpuBackend
    assert len(messages(caplog)) == 1 and said in messages(caplog)[0] and "slow" in messages(caplog)[0]


def test_key_slots_of_the_mixed_batch_match_hand_computed_values():
    backend = PackedVarlenBackend(varlen_attn_2_11)
    runner, kv = runner_for(backend)
    meta = backend.build_metadata(runner._prepare(*hand_made_batch()), kv.num_kv_heads, runner.to_device)
    tables = [[7, 3], [1, 9, 2], [4, 5], [6, 0, 8]]
    lengths = [5, 9, 5, 11]
    assert meta.key_slots.tolist() == [t[p // BS] * BS + p % BS for t, n in zip(tables, lengths) for p in range(n)]
    assert meta.key_slots.dtype == torch.int64


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(4, 2, 16), (4, 4, 8), (6, 2, 32)])
def test_packed_backend_equals_the_reference_on_a_mixed_batch(num_heads, num_kv_heads, head_dim):
    """Decodes, speculative rows, a fresh prefill and a chunk over cached keys, GQA: the
    gathered keys through 2.11's call (FlashAttention's math in PyTorch) give the reference's
    output; a decode-only step asks for the (-1, -1) window, a mixed one for causal."""
    gen = torch.Generator().manual_seed(0)
    runner, kv = runner_for(ReferenceVarlenBackend(), num_kv_heads, head_dim)
    cache = LayerCache(torch.randn(kv.k[0].shape, generator=gen), torch.randn(kv.v[0].shape, generator=gen))
    packed = PackedVarlenBackend(varlen_attn_2_11)
    varlen_attn_2_11.windows.clear()
    for seqs, num_new in (hand_made_batch(), ([s for s in hand_made_batch()[0] if s.request_id == "decode"], [1])):
        layout = runner._prepare(seqs, num_new)
        q = torch.randn(len(layout.input_ids), num_heads, head_dim, generator=gen)
        want = runner.backend.forward(q, None, None, cache, runner.backend.build_metadata(
            layout, num_kv_heads, runner.to_device), head_dim ** -0.5)
        got = packed.forward(q, None, None, cache, packed.build_metadata(layout, num_kv_heads, runner.to_device),
                             head_dim ** -0.5)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert varlen_attn_2_11.windows == [(-1, 0), (-1, -1)]


@pytest.mark.parametrize("backend", [PackedVarlenBackend(varlen_attn_2_11), VarlenBackend(varlen_attn_2_12)],
                         ids=["packed", "paged"])
def test_the_probe_passes_a_right_kernel(backend):
    assert choice.probe(backend, CPU, torch.float32, (4, 2, 16)) is None


def test_the_probe_catches_each_wrong_kernel():
    assert "off by" in choice.probe(PackedVarlenBackend(top_left_varlen_attn), CPU, torch.float32, (4, 2, 16))

    def no_causal_mask(*args, window_size=(-1, -1), **kwargs):
        return varlen_attn_2_11(*args, window_size=(-1, -1), **kwargs)
    assert "off by" in choice.probe(PackedVarlenBackend(no_causal_mask), CPU, torch.float32, (4, 2, 16))

    def reads_the_whole_page(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), **kwargs):
        return varlen_attn_2_12(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size,
                                seqused_k=kwargs["seqused_k"] * 0 + k.shape[1] * kwargs["block_table"].shape[1],
                                block_table=kwargs["block_table"], enable_gqa=True)
    assert "off by" in choice.probe(VarlenBackend(reads_the_whole_page), CPU, torch.float32, (4, 2, 16))
