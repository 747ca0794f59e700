"""fp8, w8a16 and w4a16 (pipeline/layers/quantization/weight_only.py), on the CPU: each quantized linear
within a bounded error of float32 for odd and model shapes and 1, 64 and 1,024 rows; the
CPU op equal to the quantization formula it stands for; what the CUDA op computes (its
formula in plain PyTorch) equal to the CPU op up to bf16 rounding; the CUDA calls passing
torch's own shape and layout checks (fake CUDA tensors: torch's meta functions mirror the
CUDA kernels' checks); the model quantized linear by linear while loading; and greedy runs
of the engine on the tiny Llama, its logits close to float32's."""
from __future__ import annotations

import gc

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from pipeline import Engine, EngineConfig, Request, SamplingParams
from pipeline.engine_key import engine_key
from pipeline.layers.quantization import weight_only as wq
from pipeline.layers.quantization.modes import QUANTIZED_LAYERS, linear_quantizer, quantize
from pipeline.models.loader import load_model
from engine_helpers import all_blocks_free, check_output, greedy, run

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # see conftest

CPU = torch.device("cpu")
MODES = ("fp8", "w8a16", "w4a16")
CLASSES = {"fp8": wq.Fp8Linear, "w8a16": wq.Int8WeightLinear, "w4a16": wq.Int4WeightLinear}
WEIGHT_DTYPES = {"fp8": torch.float8_e4m3fn, "w8a16": torch.int8, "w4a16": torch.uint8}   # CPU int4: uint8 pairs
# Worst row of the tests below, relative to float32 (measured: fp8 0.062 (3 mantissa bits,
# weights and activations), w8a16 0.0073, w4a16 0.098 (16 levels a group of 32 to 128)).
# A wrong scale, zero, packing or padding is off by 30% to 100%.
ROW_BOUND = {"fp8": 0.08, "w8a16": 0.012, "w4a16": 0.13}
SHAPES = [(37, 53, True), (64, 128, False), (160, 96, True)]   # (in, out, bias): padded and not


def row_errors(got: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    got, expected = got.float(), expected.float()
    return (got - expected).norm(dim=-1) / expected.norm(dim=-1)


def make(mode: str, linear: nn.Linear, dtype=torch.float32):
    kw = dict(keep_unpacked=True) if mode == "w4a16" else {}
    with torch.no_grad():
        return CLASSES[mode].from_linear(linear, CPU, dtype, **kw).eval()


# ---- each linear against float32 -----------------------------------------------------------

@pytest.mark.parametrize("rows", [1, 64, 1024])
@pytest.mark.parametrize("in_features, out_features, bias", SHAPES)
@pytest.mark.parametrize("mode", MODES)
def test_quantized_linear_is_within_a_bounded_error_of_float32(mode, in_features, out_features, bias, rows):
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=bias)
    x = torch.randn(rows, in_features)
    layer = make(mode, linear)
    with torch.inference_mode():
        expected = linear(x)
        got = layer(x)
        got_bf16 = make(mode, linear, torch.bfloat16)(x.bfloat16())
    assert got.shape == expected.shape and got.dtype == torch.float32
    assert got_bf16.shape == expected.shape and got_bf16.dtype == torch.bfloat16
    errors = row_errors(got, expected)
    assert errors.max() < ROW_BOUND[mode]
    assert errors.min() > 1e-4   # really quantized (a float path would be ~1e-7)
    assert row_errors(got_bf16, expected).max() < ROW_BOUND[mode] + 0.01
    assert layer.weight.dtype == WEIGHT_DTYPES[mode] and not layer.weight.requires_grad
    if in_features % 32 == 0 and out_features % 16 == 0:   # unpadded: a quarter of float32's bytes, an eighth
        weight_bytes = sum(p.numel() * p.element_size() for n, p in layer.named_parameters() if n != "bias")
        assert weight_bytes / (linear.weight.numel() * 4) < {"fp8": 0.27, "w8a16": 0.27, "w4a16": 0.16}[mode]


@pytest.mark.parametrize("mode", MODES)
def test_leading_dimensions_zero_rows_and_rows_of_any_scale(mode):
    """Per-token scales (fp8) and per-channel weights: a row 1e-3 or 1e3 times another is as
    accurate as it; a zero row gives the bias (no NaN from a zero scale); [batch, tokens,
    features] gives the same as the flat rows."""
    torch.manual_seed(1)
    linear = nn.Linear(96, 48)
    x = torch.randn(6, 96) * torch.tensor([1e-3, 1.0, 1e3, 0.0, 5.0, 1.0])[:, None]
    layer = make(mode, linear)
    with torch.inference_mode():
        got, expected = layer(x), linear(x)
        keep = [0, 1, 2, 4, 5]
        assert row_errors(got[keep], expected[keep]).max() < ROW_BOUND[mode]
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got[3], linear.bias.detach(), atol=1e-6, rtol=0)
        torch.testing.assert_close(layer(x.view(2, 3, 96)), got.view(2, 3, 48))


# ---- the CPU op is the formula; the CUDA formula equals it up to bf16 rounding ---------------

def cpu_formula(layer, x: torch.Tensor) -> torch.Tensor:
    """What each CPU op must compute, written from the stored quantized tensors, in float32."""
    if isinstance(layer, wq.Fp8Linear):
        x8, sx = wq.quantize_fp8_rows(layer.pad_input(x, layer.weight.shape[1]))
        y = (x8.float() @ layer.weight.float().t()) * sx * layer.weight_scale
    elif isinstance(layer, wq.Int8WeightLinear):
        y = (layer.pad_input(x, layer.weight.shape[1]) @ layer.weight.float().t()) * layer.scale.float()
    else:   # the CPU kernel: (q - 8) * s + z in float32, no rounding of the dequantized weight
        s = layer.scales_and_zeros[..., 0].float().t().repeat_interleave(layer.group_size, 1)
        z = layer.scales_and_zeros[..., 1].float().t().repeat_interleave(layer.group_size, 1)
        w = (layer.q.float() - 8) * s + z
        y = layer.pad_input(x, w.shape[1]) @ w.t()
    y = y[:, :layer.out_features]
    return y if layer.bias is None else y + layer.bias


@pytest.mark.parametrize("in_features, out_features, bias", SHAPES)
@pytest.mark.parametrize("mode", MODES)
def test_the_cpu_op_computes_the_quantization_formula(mode, in_features, out_features, bias):
    torch.manual_seed(2)
    layer = make(mode, nn.Linear(in_features, out_features, bias=bias))
    x = torch.randn(64, in_features)
    with torch.inference_mode():
        assert row_errors(layer(x), cpu_formula(layer, x)).max() < 2e-5


@pytest.mark.parametrize("rows", [1, 64, 1024])
@pytest.mark.parametrize("mode", MODES)
def test_the_cuda_formula_equals_the_cpu_op_up_to_bf16_rounding(mode, rows):
    """reference() is the CUDA op's arithmetic (fp8: e4m3 products summed in float32, both
    scales, rounded once; w8a16: cuBLAS's bf16 product, then the scale; w4a16: tinygemm's
    bf16 dequantized weight): in bf16 it differs from the CPU op only by roundings (well
    under 1%), against 4-10% of quantization error. fp8's arithmetic is the same op."""
    torch.manual_seed(3)
    linear = nn.Linear(160, 96, bias=True)
    layer = make(mode, linear, torch.bfloat16)
    x = torch.randn(rows, 160).bfloat16()
    with torch.inference_mode():
        cpu, cuda = layer(x), layer.reference(x)
        expected = linear(x.float())
    assert cuda.dtype == cpu.dtype == torch.bfloat16
    assert row_errors(cuda, cpu).max() < {"fp8": 2e-3, "w8a16": 1e-2, "w4a16": 1e-2}[mode]
    assert row_errors(cuda, expected).max() < ROW_BOUND[mode] + 0.01


def test_quantization_arithmetic():
    torch.manual_seed(4)
    w = torch.randn(24, 256) * torch.logspace(-3, 3, 24)[:, None]
    w[5] = 0
    # fp8: each row's largest magnitude is 448 exactly; 3 mantissa bits: |error| <= 2^-4 of a value
    # (for normals; subnormals below 2^-6 * scale have an absolute error of at most 2^-10 * scale).
    w8, scale = wq.quantize_fp8_rows(w)
    assert w8.dtype == torch.float8_e4m3fn and scale.shape == (24, 1)
    assert torch.equal(w8.float().abs().amax(1)[[i for i in range(24) if i != 5]], torch.full((23,), 448.0))
    back = w8.float() * scale
    assert ((back - w).abs() <= w.abs() / 16 * (1 + 1e-5) + scale * 2 ** -9).all()
    assert torch.equal(back[5], torch.zeros(256))
    # int8: symmetric per row, |error| <= half a step
    q, s = wq.quantize_int8_rows(w)
    assert q.dtype == torch.int8 and q.abs().max() == 127 and s.shape == (24,)
    assert ((q.float() * s[:, None] - w).abs() <= s[:, None] / 2 * (1 + 1e-5)).all()
    # int4: q in [0, 15], per group |error| <= half a step (+ bf16 rounding of s and z)
    q4, sz = wq.quantize_int4_groups(w, 128)
    assert q4.dtype == torch.int32 and q4.min() >= 0 and q4.max() <= 15
    assert sz.shape == (2, 24, 2) and sz.dtype == torch.bfloat16
    back4 = wq.dequantize_int4(q4, sz, 128).float()
    step = sz[..., 0].float().t().repeat_interleave(128, 1)
    zero = sz[..., 1].float().t().repeat_interleave(128, 1)
    error = (back4 - w).abs()
    # half a step, and the bf16 roundings of s (at most 15 steps away), z and the result
    assert (error <= step / 2 + (16 * step + zero.abs() + w.abs()) * 2 ** -8 + 1e-6).all()
    assert (error / step)[[i for i in range(24) if i != 5]].mean() < 0.3   # uniform rounding: 0.25


def test_int4_packing_for_cuda_puts_the_even_k_in_the_high_nibble():
    """_convert_weight_to_int4pack (torch >= 2.5) takes [n, k / 2] uint8 and reads element 2j
    from the high nibble of byte j, 2j + 1 from the low one (int4mm.cu)."""
    q = torch.tensor([[1, 2, 3, 4], [15, 0, 8, 7]], dtype=torch.int32)
    packed = wq.pack_int4_for_cuda(q)
    assert packed.dtype == torch.uint8 and packed.tolist() == [[0x12, 0x34], [0xF0, 0x87]]
    q = torch.randint(0, 16, (32, 256), dtype=torch.int32)
    assert torch.equal(wq.unpack_int4_cuda_layout(wq.pack_int4_for_cuda(q)), q)


@pytest.mark.parametrize("k, n, layout", [(2048, 8192, (32, 8, 2048, 8192)), (64, 128, (32, 4, 64, 128)),
                                          (96, 40, (32, 2, 96, 48)), (37, 53, (32, 4, 64, 64))])
def test_int4_layout_fits_both_kernels(k, n, layout):
    group, tiles, kp, np_ = wq.int4_layout(k, n)
    assert (group, tiles, kp, np_) == layout
    assert kp % group == 0 and kp % (16 * tiles) == 0 and np_ % 16 == 0 and kp >= k and np_ >= n


# ---- the CUDA calls, on fake CUDA tensors ----------------------------------------------------

@pytest.fixture
def fake_cuda():
    """Tensors that say they are on CUDA, with no data: torch's meta functions run instead of
    the kernels and make the CUDA kernels' shape, dtype and layout checks (for _scaled_mm:
    row-major first operand, column-major second, K and N multiples of 16, row-wise scale
    shapes). Only what those functions cover can be checked this way."""
    mode = FakeTensorMode()
    cuda = torch.device("cuda")

    def fake(t: torch.Tensor) -> torch.Tensor:
        return FakeTensor(mode, t.to("meta"), cuda)
    with mode:
        yield fake


@pytest.mark.parametrize("in_features", [37, 2048])   # K padded per call, and the 1B's hidden size
@pytest.mark.parametrize("mode", MODES)
def test_the_cuda_path_passes_torchs_own_checks(fake_cuda, mode, in_features):
    torch.manual_seed(5)
    n = 96
    layer = make(mode, nn.Linear(in_features, n, bias=True), torch.bfloat16)
    if mode == "w4a16":   # the CUDA packing: uint8 pairs made here, the op's own shape from its meta function
        group, tiles, kp, np_ = wq.int4_layout(in_features, n)
        packed = torch.ops.aten._convert_weight_to_int4pack(fake_cuda(wq.pack_int4_for_cuda(layer.q)), tiles)
        assert packed.shape == (np_ // 8, kp // (16 * tiles), 32, tiles // 2) and packed.dtype == torch.int32
        layer.weight = nn.Parameter(packed, requires_grad=False)
    for name, p in list(layer.named_parameters(recurse=False)):
        if not p.is_cuda:
            setattr(layer, name, nn.Parameter(fake_cuda(p.detach()), requires_grad=False))
    for rows in (1, 64, 1024):
        y = layer(fake_cuda(torch.zeros(rows, in_features, dtype=torch.bfloat16)))
        assert y.is_cuda and y.shape == (rows, n) and y.dtype == torch.bfloat16
    if mode == "fp8":   # the checks are live: a row-major weight operand is refused
        x8 = fake_cuda(torch.zeros(4, layer.weight.shape[1], dtype=torch.float8_e4m3fn))
        row_major = fake_cuda(torch.zeros(layer.weight.shape[1], layer.weight.shape[0], dtype=torch.float8_e4m3fn))
        with pytest.raises(RuntimeError, match="col_major"):
            torch._scaled_mm(x8, row_major, scale_a=fake_cuda(torch.ones(4, 1)), scale_b=layer.weight_scale,
                             out_dtype=torch.bfloat16)


def test_modes_refuse_a_gpu_that_cannot_run_them(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match="compute capability 8.9"):
        linear_quantizer("fp8", torch.device("cuda"), torch.bfloat16)
    assert linear_quantizer("w4a16", torch.device("cuda"), torch.bfloat16) is not None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    with pytest.raises(ValueError, match="8.0 or later"):
        linear_quantizer("w4a16", torch.device("cuda"), torch.bfloat16)
    assert linear_quantizer("w8a16", torch.device("cuda"), torch.bfloat16) is not None
    # a CPU runs all three
    assert all(linear_quantizer(m, CPU, torch.float32) is not None for m in MODES)


# ---- quantized while loading ------------------------------------------------------------------

def test_the_loader_quantizes_one_linear_at_a_time(tiny_model_dir):
    """Each decoder linear is handed over as soon as its tensors are read: when one is
    quantized, at most one other float decoder linear exists (a fused q/k/v waiting for
    its last part, read after o_proj), not the eight of the model; and what was handed
    over is the checkpoint's weight."""
    before = {id(o) for o in gc.get_objects() if type(o) is nn.Linear}
    float_alive, seen = [], []

    def quantize_linear(linear):
        float_alive.append(sum(1 for o in gc.get_objects() if type(o) is nn.Linear and id(o) not in before
                               and not o.weight.is_meta and o.out_features != vocab))
        seen.append(linear.weight.detach().clone())
        return wq.quantized_linear("w8a16", linear, CPU, torch.float32)

    from pipeline.models.loader import read_hf_config
    vocab = read_hf_config(tiny_model_dir)["vocab_size"]
    model, args = load_model(tiny_model_dir, torch.float32, CPU, quantize_linear, QUANTIZED_LAYERS)
    assert len(seen) == 4 * args.num_layers and max(float_alive) <= 2
    swapped = [m for m in model.modules() if isinstance(m, wq.Int8WeightLinear)]
    assert len(swapped) == 4 * args.num_layers and not any(m.training for m in swapped)
    assert not any(isinstance(m, nn.Linear) for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in QUANTIZED_LAYERS)
    # What was handed over is a float load's weights, and quantizing a float model afterwards
    # gives the very same int8 values.
    reference, _ = load_model(tiny_model_dir, torch.float32, CPU)
    float_weights = [m.weight.detach() for n, m in reference.named_modules() if n.rsplit(".", 1)[-1] in QUANTIZED_LAYERS]
    assert all(sum(torch.equal(w, f) for f in float_weights) == 1 for w in seen)
    after = quantize(reference, "w8a16", CPU, torch.float32)
    for a, b in zip(swapped, [m for m in after.modules() if isinstance(m, wq.Int8WeightLinear)], strict=True):
        assert torch.equal(a.weight, b.weight) and torch.equal(a.scale, b.scale)


# ---- the engine on the tiny Llama ---------------------------------------------------------------

PROMPT = [504, 2365, 6354, 1604, 278, 3900, 11, 9000, 120, 77, 4411, 3030]
# Teacher-forced logits of PROMPT against the float32 engine: mean |error| over their standard
# deviation (measured: bf16 unquantized 0.005, fp8 0.03, w8a16 0.006-0.008, w4a16 0.094-0.098).
LOGIT_BOUND = {"fp8": 0.06, "w8a16": 0.02, "w4a16": 0.15}


def prompt_logits(engine: Engine) -> torch.Tensor:
    """The logits of every PROMPT position but the last, as the engine computes them (the
    compute_logits call for those rows kept)."""
    kept, compute = [], engine.model.compute_logits

    def keeping(hidden):
        logits = compute(hidden)
        kept.append(logits.float().clone())
        return logits
    engine.model.compute_logits = keeping
    try:
        run(engine, [Request("p", prompt_token_ids=PROMPT, params=SamplingParams(temperature=0, max_tokens=1,
                                                                               prompt_logprobs=0))])
    finally:
        engine.model.compute_logits = compute
    return next(t for t in kept if t.shape[0] == len(PROMPT) - 1)


@pytest.fixture(scope="module")
def float_logits(tiny_model_dir):
    return prompt_logits(Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), dtype="float32",
                                             num_kv_blocks=64)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", MODES)
def test_the_engine_runs_each_mode_on_the_tiny_llama(tiny_model_dir, float_logits, mode, dtype):
    engine = Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), quantization=mode, dtype=dtype,
                                 num_kv_blocks=64))
    layers = [getattr(m, "inner", m)   # inside a batch-invariant wrapper (pipeline/layers/batch_invariant.py)
              for n, m in engine.model.named_modules() if n.rsplit(".", 1)[-1] in QUANTIZED_LAYERS]
    assert len(layers) == 8 and all(type(m) is CLASSES[mode] and not m.training for m in layers)
    assert all(m.weight.dtype == WEIGHT_DTYPES[mode] for m in layers)
    assert engine.model.lm_head.weight.dtype == engine.model.model.embed_tokens.weight.dtype == engine.dtype
    logits = prompt_logits(engine)
    assert (logits - float_logits).abs().mean() / float_logits.std() < LOGIT_BOUND[mode]
    outs = run(engine, [Request("a", prompt_token_ids=PROMPT, params=greedy(8, ignore_eos=True)),
                        Request("b", prompt_token_ids=PROMPT[:5], params=greedy(8, ignore_eos=True)),
                        Request("c", prompt="Hello", params=SamplingParams(temperature=1.0, seed=1, max_tokens=5))])
    for out in outs.values():
        check_output(out, engine)
    assert outs["a"].output_tokens == outs["b"].output_tokens == 8 and outs["c"].output_tokens == 5
    assert all_blocks_free(engine)


def test_each_mode_has_an_engine_key_of_its_own():
    keys = {engine_key({"quantization": mode}) for mode in ("none", "int8", "nf4", "w8a8", *MODES)}
    assert len(keys) == 7
