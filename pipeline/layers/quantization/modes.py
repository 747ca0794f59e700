"""Weight quantization by module swap: PyTorch's own fp8, w8a16 and w4a16 (weight_only.py,
made for CUDA, with CPU twins), bitsandbytes int8 (LLM.int8) or nf4, or w8a8 on a CPU.

The decoder's linear layers are replaced by weight_only's modules, by bitsandbytes
modules holding quantized weights (any device), or for w8a8 by int8_linear.Int8Linear
(CPU only: fbgemm's int8 GEMM, or oneDNN's on a CPU with AMX, faster than float32 there,
where bitsandbytes' CPU kernels are slower); embeddings, norms and the (often tied) LM head stay in the model dtype.
w8a8 is smoothed first (smoothing.py), which needs one forward of the float model: the
engine applies it with quantize_w8a8 once it can run the model, so `quantize` leaves a
w8a8 model as it is.

All but w8a8 quantize one linear at a time (`linear_quantizer`): the loader hands each
decoder linear over as soon as its checkpoint tensors are read, so a model that fits on
the device only quantized loads (pipeline/models/loader.py).
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
from torch import nn

from pipeline.layers.quantization import weight_only

QUANTIZED_LAYERS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
BNB_CAST_LOGGER = "bitsandbytes.autograd._functions"


class CastWarningOnce(logging.Filter):
    """bitsandbytes' MatMul8bitLt logs "inputs will be cast from ... to float16" on every int8
    matmul of a bf16 or float32 input: every layer, every step. Let it through once."""
    PREFIX = "MatMul8bitLt: inputs will be cast"

    def __init__(self):
        super().__init__()
        self.seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(self.PREFIX):
            return True
        seen, self.seen = self.seen, True
        return not seen


def quantize(model: nn.Module, mode: str, device: torch.device, compute_dtype: torch.dtype) -> nn.Module:
    """Swap the decoder linears of a loaded model (the engine quantizes while loading instead)."""
    if mode == "none":
        return model
    if mode == "w8a8":
        if device.type != "cpu":
            raise ValueError("quantization 'w8a8' runs on a CPU only; on CUDA use 'int8' (bitsandbytes)")
        return model   # the engine calls quantize_w8a8 once it can run its calibration
    swap = linear_quantizer(mode, device, compute_dtype)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if name in QUANTIZED_LAYERS and isinstance(child, nn.Linear):
                setattr(parent, name, swap(child))
    return model


def linear_quantizer(mode: str, device: torch.device,
                     compute_dtype: torch.dtype) -> Callable[[nn.Linear], nn.Module] | None:
    """The function that turns one decoder nn.Linear (on any device, the CPU while loading)
    into its quantized module on `device`; None where the model is quantized after loading
    ("none": not at all, "w8a8"). Refuses a device that cannot run the mode, at once."""
    if mode in ("none", "w8a8"):
        return None
    if mode in weight_only.MODES:
        weight_only.check_device(mode, device)
        return functools.partial(weight_only.quantized_linear, mode, device=device, compute_dtype=compute_dtype)
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        raise RuntimeError(f"quantization {mode!r} needs bitsandbytes: pip install bitsandbytes") from e
    cast_logger = logging.getLogger(BNB_CAST_LOGGER)
    if not any(isinstance(f, CastWarningOnce) for f in cast_logger.filters):
        cast_logger.addFilter(CastWarningOnce())
    return functools.partial(_quantized_linear, bnb, mode=mode, device=device, compute_dtype=compute_dtype)


def _quantized_linear(bnb, linear: nn.Linear, mode: str, device, compute_dtype) -> nn.Module:
    has_bias = linear.bias is not None
    # bitsandbytes quantizes in Parameter.to(device), and Int8Params only from CPU data: built
    # from a weight already on the GPU it would stay fp16 until the first forward. So quantize
    # from a CPU copy, in the model's own dtype (nf4 keeps it as its quant_state.dtype).
    weight = linear.weight.data.to("cpu", compute_dtype)
    if mode == "int8":
        # threshold=0 keeps every column in int8 (no fp16 outlier path): smallest and fastest.
        q = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=has_bias,
                                has_fp16_weights=False, threshold=0.0, device="meta")
        q.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
    else:
        q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=has_bias,
                              quant_type="nf4", compute_dtype=compute_dtype, device="meta")
        q.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4", module=q)
    if has_bias:
        q.bias = nn.Parameter(linear.bias.data.to("cpu", compute_dtype), requires_grad=False)
    # Moving the parameters is what quantizes them; a new module starts in training mode.
    return q.to(device).eval()


def quantize_w8a8(model: nn.Module, run_calibration: Callable[[], object]) -> nn.Module:
    """Smooth the float model with the input ranges one run_calibration() records (a forward
    of smoothing.CALIBRATION_TEXT), then swap its decoder linears for Int8Linear."""
    from pipeline.layers.quantization.int8_linear import quantize_linear_layers
    from pipeline.layers.packed_linear import pack_linear_layers
    from pipeline.layers.quantization.smoothing import recording_input_ranges, smooth_decoder
    with recording_input_ranges(model) as ranges:
        run_calibration()
    smooth_decoder(model, ranges)
    quantize_linear_layers(model, QUANTIZED_LAYERS)
    # The engine packs weights only unquantized; the float LM head is as costly as a
    # quarter of the decoder in a decode step, so it is packed here as it would be then.
    pack_linear_layers(model)
    return model.eval()
