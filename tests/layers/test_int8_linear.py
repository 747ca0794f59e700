"""CPU int8 linear layers (`--quantization w8a8`, pipeline/layers/quantization/int8_linear.py): bounded
error against float32 for any shape and row count, a row's result independent of its
batch, the kernel chosen once and logged, the PyTorch fallback forced and equal; and the
engine on the tiny Llama: it generates, and prefix caching, preemption and speculative
decoding give the very tokens they give without them."""
from __future__ import annotations

import logging
import random

import pytest
import torch
from torch import nn

from pipeline import Engine, EngineConfig, Request
from pipeline.engine_key import engine_key
from pipeline.layers.quantization import int8_linear
from pipeline.kernels import cpu_kernels
from pipeline.layers.quantization.int8_linear import FULL_ACTIVATIONS, NARROW_ACTIVATIONS, Int8Gemm, Int8Linear, int8_gemm
from pipeline.layers.packed_linear import PackedLinear, _mkl
from pipeline.layers.quantization.modes import quantize
from engine_helpers import BIG_POOL, all_blocks_free, check_output, greedy, random_prompt, run

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # see conftest

# The PyTorch path with the chosen kernel's activation levels (255 on a CPU with VNNI).
REFERENCE = Int8Gemm("reference", int8_gemm().activation_qparams, "test")
ONEDNN = Int8Gemm("onednn", FULL_ACTIVATIONS, "test")
needs_fbgemm = pytest.mark.skipif(int8_linear._fbgemm_op() is None, reason="this PyTorch has no fbgemm")
# oneDNN's int8 product serves 255 levels only where it passes the self-check (AMX, VNNI).
ONEDNN_USABLE = int8_linear._onednn_ops() and int8_linear._agrees_with_reference(FULL_ACTIVATIONS, "onednn")
needs_onednn = pytest.mark.skipif(not ONEDNN_USABLE, reason="oneDNN's int8 linear does not serve 255 levels here")
# The library kernels this machine can run (the PyTorch path is not bit-stable across batch sizes).
LIBRARY_GEMMS = ([Int8Gemm("fbgemm", int8_gemm().activation_qparams if int8_gemm().kernel == "fbgemm"
                           else NARROW_ACTIVATIONS, "test")] if int8_linear._fbgemm_op() else []) + (
                    [ONEDNN] if ONEDNN_USABLE else [])


@pytest.fixture
def fresh_choice():
    """int8_gemm() made again in the test (and again after it, as the process had it)."""
    int8_gemm.cache_clear()
    yield
    int8_gemm.cache_clear()


def row_errors(got: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    return (got - expected).norm(dim=-1) / expected.norm(dim=-1)


@pytest.mark.parametrize("rows", [1, 3, 64, 1024])
@pytest.mark.parametrize("in_features, out_features, bias", [(37, 53, True), (576, 960, False), (1536, 576, True)])
def test_int8_linear_is_within_a_bounded_error_of_float32(rows, in_features, out_features, bias):
    """129 activation levels per token (255 with VNNI) and 255 weight levels per channel:
    ~2% per row on Gaussian data (measured: 1.5-2.2%); the bound leaves room, a broken
    scale or packing would be off by 100%."""
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=bias)
    x = torch.randn(rows, in_features)
    with torch.inference_mode():
        expected = linear(x)
        got = Int8Linear(linear)(x)
        reference = Int8Linear(linear, REFERENCE)(x)
    assert got.shape == expected.shape and got.dtype == torch.float32
    assert row_errors(got, expected).max() < 0.05
    # The chosen kernel and the PyTorch path compute the same arithmetic (float32 sums; a
    # value exactly between two levels may round the other way: one step in that row).
    assert row_errors(got, reference).median() < 1e-5 and row_errors(got, reference).max() < 1e-2


def test_rows_of_any_scale_leading_dimensions_and_bfloat16():
    """Per-token scales: a row 1e-3 or 1e3 times another is as accurate as it; a zero row
    gives the bias; [batch, tokens, features] and bf16 in give the same shape and dtype out."""
    torch.manual_seed(1)
    linear = nn.Linear(96, 40)
    x = torch.randn(6, 96) * torch.tensor([1e-3, 1.0, 1e3, 0.0, 5.0, 1.0])[:, None]
    with torch.inference_mode():
        layer = Int8Linear(linear)
        got = layer(x)
        expected = linear(x)
        assert row_errors(got[[0, 1, 2, 4, 5]], expected[[0, 1, 2, 4, 5]]).max() < 0.05
        torch.testing.assert_close(got[3], linear.bias.detach())
        assert layer(x.view(2, 3, 96)).shape == (2, 3, 40)
        torch.testing.assert_close(layer(x.view(2, 3, 96)), got.view(2, 3, 40))
        bf16 = layer(x.bfloat16())
        assert bf16.dtype == torch.bfloat16
        assert row_errors(bf16.float()[[1, 4, 5]], expected[[1, 4, 5]]).max() < 0.06


@pytest.mark.parametrize("gemm", LIBRARY_GEMMS, ids=lambda g: g.kernel)
def test_a_rows_result_does_not_depend_on_its_batch(gemm):
    """Fixed activation parameters after per-token scaling: bit-identical rows alone and
    in batches of any size (what preemption, prefix caching and speculation rely on)."""
    torch.manual_seed(2)
    layer = Int8Linear(nn.Linear(200, 120), gemm)
    x = torch.randn(300, 200) * torch.logspace(-2, 2, 300)[:, None]
    with torch.inference_mode():
        batch = layer(x)
        for lo, hi in [(0, 1), (5, 6), (7, 64), (100, 299)]:
            assert torch.equal(layer(x[lo:hi]), batch[lo:hi]), (lo, hi)


@needs_fbgemm
def test_saturating_activation_range_is_caught_by_the_self_check():
    """255 activation levels overflow vpmaddubsw's int16 sums without VNNI: the self-check
    sees it there (and passes where the CPU has VNNI); 129 levels always pass."""
    assert int8_linear._agrees_with_reference(NARROW_ACTIVATIONS)
    vnni = "avx512_vnni" in int8_linear.cpu_flags()
    assert int8_linear._agrees_with_reference(int8_linear.FULL_ACTIVATIONS) == vnni


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_row_quantizer_and_scaler_compute_the_pytorch_formula_bit_for_bit(dtype):
    """kernels/quantize_rows.c against what int8_linear's fallback writes in PyTorch: rows of
    any scale, a zero row (zero point, top at the floor), a row exactly on a rounding tie,
    odd widths, bit for bit; and the way back (times top, plus the bias, into the dtype)."""
    if not cpu_kernels.available():
        pytest.skip("no C compiler: the PyTorch path serves")
    torch.manual_seed(4)
    x = (torch.randn(37, 131) * torch.logspace(-3, 3, 37)[:, None]).to(dtype)
    x[3] = 0
    x[5] = 0
    x[5, :5] = torch.tensor([127, -63.5, 0.5, 1.5, -2.5])   # top 127: the factor is 1, and these are ties
    q, top = cpu_kernels.quantize_rows_u8(x, 127, 128)
    rows = x.float()
    expected_top = rows.abs().amax(1, keepdim=True).clamp(min=int8_linear.MIN_TOP)
    factor = torch.full_like(expected_top, 127).div_(expected_top)
    assert torch.equal(top, expected_top)
    assert torch.equal(q, torch.round(rows * factor).add(128).clamp(0, 255).to(torch.uint8))
    assert (q[3] == 128).all() and q[5, :5].tolist() == [255, 128 - 64, 128, 130, 128 - 2]   # half to even
    # The way back may fuse the multiply-add (one rounding where PyTorch has two): equal within that.
    acc, cols, bias = torch.randn(37, 53), torch.rand(53), torch.randn(53)
    tight = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-6)
    torch.testing.assert_close(cpu_kernels.scale_rows(acc.clone(), top, cols, bias, dtype),
                               (acc * top * cols + bias).to(dtype), **tight)
    assert torch.equal(cpu_kernels.scale_rows(acc.clone(), top, cols, None, dtype), (acc * top * cols).to(dtype))


@needs_onednn
@pytest.mark.parametrize("rows", [1, 8, 300])
def test_the_onednn_path_is_bounded_and_its_pytorch_twin_equal(rows, monkeypatch):
    """oneDNN's int8 product (the AMX path) with the C row quantizer: within the bound of
    float32, equal to the reference arithmetic but for rounding ties, and bit for bit the
    same quantized product as its own PyTorch fallback (the one taken where the C kernels
    cannot be built)."""
    torch.manual_seed(5)
    linear = nn.Linear(576, 960, bias=True)
    x = torch.randn(rows, 576) * torch.logspace(-2, 2, rows)[:, None]
    with torch.inference_mode():
        layer = Int8Linear(linear, ONEDNN)
        got, expected = layer(x), linear(x)
        reference = Int8Linear(linear, Int8Gemm("reference", FULL_ACTIVATIONS, "test"))(x)
        assert row_errors(got, expected).max() < 0.05
        assert row_errors(got, reference).median() < 1e-5 and row_errors(got, reference).max() < 1e-2
        bf16 = layer(x.bfloat16())
        monkeypatch.setattr(cpu_kernels, "serves", lambda *tensors: False)
        fallback = layer(x)
        # The same quantized rows and product; the way back may differ by a fused multiply-add.
        torch.testing.assert_close(fallback, got, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(layer(x.bfloat16()), bf16, rtol=0.01, atol=1e-5)


def test_amx_picks_onednn_unless_forced_and_a_cpu_without_it_does_not(fresh_choice, monkeypatch):
    flags = int8_linear.cpu_flags()
    monkeypatch.setattr(int8_linear, "cpu_flags", lambda: flags - {"amx_int8"})
    assert int8_gemm().kernel != "onednn"
    if not ONEDNN_USABLE:
        return
    int8_gemm.cache_clear()
    monkeypatch.setattr(int8_linear, "cpu_flags", lambda: flags | {"amx_int8"})
    assert int8_gemm() == Int8Gemm("onednn", FULL_ACTIVATIONS, "CPU with AMX: 255 activation levels")
    int8_gemm.cache_clear()
    monkeypatch.setenv(int8_linear.FORCE_ENV, "fbgemm")
    assert int8_gemm().kernel == ("fbgemm" if int8_linear._fbgemm_op() else "reference")


def test_kernel_choice_is_made_once_and_logged_once(fresh_choice, caplog):
    with caplog.at_level(logging.INFO, logger="pipeline.layers.quantization.int8_linear"):
        for _ in range(3):
            Int8Linear(nn.Linear(16, 8))
    records = [r for r in caplog.records if r.getMessage().startswith("int8 linear layers:")]
    assert len(records) == 1
    assert int8_gemm().kernel in records[0].getMessage()


def test_forced_fallback_is_used_and_agrees(fresh_choice, monkeypatch, tiny_model_dir):
    torch.manual_seed(3)
    linear = nn.Linear(64, 48)
    x = torch.randn(10, 64)
    with torch.inference_mode():
        chosen = Int8Linear(linear)(x)
    # The forced path keeps 129 activation levels, what a CPU without VNNI has; where the
    # chosen kernel has 255 the two differ by the coarser one's rounding (~1.5% a row).
    bound = 1e-2 if int8_gemm().activation_qparams == NARROW_ACTIVATIONS else 0.04
    int8_gemm.cache_clear()
    monkeypatch.setenv(int8_linear.FORCE_ENV, "reference")
    assert int8_gemm() == Int8Gemm("reference", NARROW_ACTIVATIONS, f"{int8_linear.FORCE_ENV}=reference")
    layer = Int8Linear(linear)
    assert layer.gemm.kernel == "reference" and not hasattr(layer, "packed")
    with torch.inference_mode():
        assert row_errors(layer(x), chosen).max() < bound
        assert row_errors(layer(x), linear(x)).max() < 0.05
    engine = Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), quantization="w8a8", **BIG_POOL))
    assert engine.model.model.layers[0].mlp.down_proj.inner.gemm.kernel == "reference"   # .inner: batch-invariant
    out = run(engine, [Request("q", prompt_token_ids=[504, 2365, 6354, 1604], params=greedy(6, ignore_eos=True))])
    check_output(out["q"], engine)
    assert out["q"].output_tokens == 6


def test_w8a8_is_cpu_only_and_has_an_engine_key_of_its_own():
    with pytest.raises(ValueError, match="CPU only"):
        quantize(nn.Sequential(), "w8a8", torch.device("cuda"), torch.float32)
    keys = {engine_key({"quantization": mode}) for mode in ("none", "int8", "nf4", "w8a8")}
    assert len(keys) == 4


# ---- the engine on the tiny Llama ------------------------------------------------------------

def w8a8_engine(model_dir, **overrides) -> Engine:
    return Engine(EngineConfig(device="cpu", model=str(model_dir), quantization="w8a8", **{**BIG_POOL, **overrides}))


@pytest.fixture(scope="module")
def tiny_w8a8(tiny_model_dir):
    return w8a8_engine(tiny_model_dir)


def mixed_requests(seed: int, n: int, prefix_len: int = 0) -> list[Request]:
    rng = random.Random(seed)
    prefix = random_prompt(rng, prefix_len)
    return [Request(f"r{i}", prompt_token_ids=prefix + random_prompt(rng, rng.randint(1, 60)),
                    params=greedy(rng.randint(4, 20), ignore_eos=True)) for i in range(n)]


def test_engine_quantizes_every_decoder_linear_and_generates(tiny_w8a8):
    model = tiny_w8a8.model
    for layer in model.model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert type(linear.inner) is Int8Linear   # inside the batch-invariant wrapper
    assert type(model.lm_head.inner) is (PackedLinear if _mkl() else nn.Linear)   # packed as without quantization
    outs = run(tiny_w8a8, mixed_requests(0, 12) + [Request("hi", prompt="Hello", params=greedy(5))])
    for out in outs.values():
        check_output(out, tiny_w8a8)
    assert all_blocks_free(tiny_w8a8)


def test_prefix_caching_gives_the_same_tokens(tiny_model_dir, tiny_w8a8):
    requests = mixed_requests(1, 10, prefix_len=3 * BIG_POOL["block_size"] + 5)
    assert tiny_w8a8.reset_prefix_cache()
    cached = run(tiny_w8a8, requests)
    plain = run(w8a8_engine(tiny_model_dir, enable_prefix_caching=False), requests)
    assert sum(o.cached_tokens for o in cached.values()) > 0
    assert {k: o.token_ids for k, o in cached.items()} == {k: o.token_ids for k, o in plain.items()}
    assert all_blocks_free(tiny_w8a8)


def test_preemption_gives_the_same_tokens(tiny_model_dir, tiny_w8a8):
    small = w8a8_engine(tiny_model_dir, num_kv_blocks=24, block_size=4)
    requests = mixed_requests(2, 10)
    expected = run(tiny_w8a8, requests)
    got = run(small, requests)
    assert small.scheduler.num_preemptions > 0
    assert {k: o.token_ids for k, o in got.items()} == {k: o.token_ids for k, o in expected.items()}
    assert all_blocks_free(small)


def test_speculative_decoding_gives_the_same_greedy_tokens(tiny_model_dir, tiny_w8a8):
    rng = random.Random(4)
    requests = []
    for i in range(8):   # repeated stretches: drafts to accept and to reject
        pattern = random_prompt(rng, rng.randint(3, 10))
        requests.append(Request(f"s{i}", prompt_token_ids=(pattern * 12)[:rng.randint(20, 100)],
                                params=greedy(rng.randint(8, 24), ignore_eos=True)))
    spec = w8a8_engine(tiny_model_dir, speculative="ngram", num_speculative_tokens=4)
    got = run(spec, requests)
    expected = run(tiny_w8a8, requests)
    assert sum(o.draft_tokens for o in got.values()) > 0
    assert {k: o.token_ids for k, o in got.items()} == {k: o.token_ids for k, o in expected.items()}
    assert all_blocks_free(spec)
