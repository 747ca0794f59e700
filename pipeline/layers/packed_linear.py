"""CPU linear layers with their weights packed once, at load: MKL for float32, oneDNN for bfloat16.

A plain matmul repacks the whole weight matrix into MKL's internal layout on every call.
In decode steps (a few to a few dozen rows against every weight of the model) that
repacking is most of the cost. MKL's packed API (cblas_sgemm_pack / cblas_sgemm_compute)
packs each weight once, at load time, and reuses it for any number of rows: measured on
this project's 2-core CPU over the 135M model's layers, 48 -> 30 ms for 8 rows, 95 -> 71 ms
for 64, 837 -> 798 ms for 1024. The cost is memory: MKL's packed form is about 3x the
float32 weight (the original is released, but a tied LM head keeps the embedding too:
the bundled model's weights grow from 515 to 1998 MiB). Packing is skipped, with a
warning, when it would take more than half of the memory available.

PyTorch exposes this only for one fixed batch size, so the CBLAS functions are called
from the MKL that PyTorch's CPU library carries, through ctypes. Where that library has
no MKL (other platforms, other builds), or a self-check fails, layers stay nn.Linear.

bfloat16 has the same repacking cost in oneDNN (which plain bf16 matmuls use on CPUs
with AVX-512 BF16 or AMX). `torch.ops.mkldnn._reorder_linear_weight` gives oneDNN's
blocked layout once (the same bytes as the bf16 weight; what torch.compile's CPU backend
does for bf16), and `_linear_pointwise` multiplies by it. Measured on this project's
AVX-512 BF16 EPYC over the 135M model's layers (identical outputs): 8 rows 20 -> 11 ms,
64 rows 51 -> 39 ms, 300 rows 189 -> 161 ms (float32, MKL-packed: 30 and 71 ms).
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

# CBLAS enumerations (mkl_cblas.h).
ROW_MAJOR, NO_TRANS, TRANS, B_MATRIX, PACKED = 101, 111, 112, 162, 151
PACKED_LAYERS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")


@functools.cache
def _mkl():
    """(pack_get_size, pack, compute) from PyTorch's MKL, or None."""
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        get_size, pack, compute = lib.cblas_sgemm_pack_get_size, lib.cblas_sgemm_pack, lib.cblas_sgemm_compute
    except (OSError, AttributeError):
        return None
    get_size.restype = ctypes.c_size_t
    get_size.argtypes = [ctypes.c_int] * 4
    pack.restype = None
    pack.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    compute.restype = None
    compute.argtypes = ([ctypes.c_int] * 6 + [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                              ctypes.c_float, ctypes.c_void_p, ctypes.c_int])
    return get_size, pack, compute


class PackedLinear(nn.Module):
    """y = x @ W^T + b with W held only in MKL's packed layout (CPU, float32)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        get_size, pack, _ = _mkl()
        self.out_features, self.in_features = linear.weight.shape
        weight = linear.weight.detach().contiguous()
        n, k = self.out_features, self.in_features
        # The row count given to pack only sizes MKL's blocking; any row count may use the result.
        size = get_size(B_MATRIX, 64, n, k)
        self.register_buffer("packed", torch.empty(-(-size // 4), dtype=torch.float32), persistent=False)
        pack(ROW_MAJOR, B_MATRIX, TRANS, 64, n, k, 1.0, weight.data_ptr(), k, self.packed.data_ptr())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The model always passes contiguous [tokens, features]: keep that path free of reshapes.
        rows = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, self.in_features).contiguous()
        m, n, k = rows.shape[0], self.out_features, self.in_features
        out = torch.empty((m, n), dtype=rows.dtype)
        if m:
            _mkl()[2](ROW_MAJOR, NO_TRANS, PACKED, m, n, k, rows.data_ptr(), k, self.packed.data_ptr(), k,
                      0.0, out.data_ptr(), n)
        if self.bias is not None:
            out.add_(self.bias)
        return out if rows is x else out.view(*x.shape[:-1], n)


class OneDnnLinear(nn.Module):
    """y = x @ W^T + b with W held only in oneDNN's blocked layout (CPU, bfloat16)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.out_features, self.in_features = linear.weight.shape
        # No batch-size hint: it measured no faster for any row count, and this serves all.
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach()),
                             persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, self.in_features).contiguous()
        if not rows.shape[0]:
            return x.new_empty((*x.shape[:-1], self.out_features))
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out if rows is x else out.view(*x.shape[:-1], self.out_features)


@functools.cache
def _onednn_bf16() -> bool:
    """oneDNN in this PyTorch build, and the CPU computes bf16 natively (else oneDNN
    emulates it and a plain matmul is no slower)."""
    from pipeline.device import cpu_has_native_bf16
    return (torch.backends.mkldnn.is_available() and cpu_has_native_bf16()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def _available_memory() -> int | None:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _packs_correctly(linear: nn.Linear, packed_class) -> bool:
    """Compare with F.linear once: guards against an MKL with another integer size or ABI,
    or a oneDNN that cannot reorder this weight."""
    dtype = linear.weight.dtype
    x = torch.randn(3, linear.in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    try:
        with torch.no_grad():
            expected = F.linear(x, linear.weight, linear.bias)
            got = packed_class(linear)(x)
    except RuntimeError as e:
        log.info("packed %s linear layers failed their self-check: %s", dtype, e)
        return False
    return torch.allclose(got.float(), expected.float(), rtol=tolerance, atol=tolerance)


def _mkl_packed_bytes(n: int, k: int) -> int:
    return _mkl()[0](B_MATRIX, 64, n, k)


def _bf16_bytes(n: int, k: int) -> int:
    return 2 * n * k


def _packed_form(dtype: torch.dtype):
    """(the packed class, bytes its weight of shape (n, k) takes), or None."""
    if dtype == torch.float32 and _mkl() is not None:
        return PackedLinear, _mkl_packed_bytes
    if dtype == torch.bfloat16 and _onednn_bf16():
        return OneDnnLinear, _bf16_bytes
    return None


def pack_linear_layers(model: nn.Module) -> int:
    """Swap the model's large linear layers for their packed form where that is possible
    (CPU; float32 with PyTorch's MKL, bfloat16 with oneDNN on a CPU with native bf16).
    Returns how many were packed."""
    candidates = [(parent, name, child) for parent in list(model.modules())
                  for name, child in parent.named_children()
                  if name in PACKED_LAYERS and type(child) is nn.Linear and child.weight.device.type == "cpu"
                  and _packed_form(child.weight.dtype) is not None]
    by_form: dict = {}
    for candidate in candidates:
        by_form.setdefault(_packed_form(candidate[2].weight.dtype), []).append(candidate)
    usable = {}
    for form, group in by_form.items():
        if _packs_correctly(group[0][2], form[0]):
            usable[form] = group
        else:
            log.warning("packed %s GEMM unavailable: linear layers use plain matmuls", group[0][2].weight.dtype)
    needed = sum(packed_bytes(*child.weight.shape)
                 for (_, packed_bytes), group in usable.items() for _, _, child in group)
    available = _available_memory()
    if usable and available is not None and needed > available / 2:
        log.warning("packing the weights would take %.1f GiB of the %.1f GiB available: linear layers "
                    "use plain matmuls (slower decode steps)", needed / 2**30, available / 2**30)
        return 0
    for (packed_class, _), group in usable.items():
        for parent, name, child in group:
            setattr(parent, name, packed_class(child))   # the unpacked weight is released (unless tied)
    return sum(len(group) for group in usable.values())
