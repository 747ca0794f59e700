"""CPU float32 linear layers on MKL's packed GEMM.

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


def _available_memory() -> int | None:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _packs_correctly(linear: nn.Linear) -> bool:
    """Compare with F.linear once: guards against an MKL with another integer size or ABI."""
    x = torch.randn(3, linear.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = F.linear(x, linear.weight, linear.bias)
        got = PackedLinear(linear)(x)
    return torch.allclose(got, expected, rtol=1e-4, atol=1e-4)


def pack_linear_layers(model: nn.Module) -> int:
    """Swap the model's large linear layers for PackedLinear where that is possible (CPU,
    float32, PyTorch built with MKL). Returns how many were packed."""
    candidates = [(parent, name, child) for parent in list(model.modules())
                  for name, child in parent.named_children()
                  if name in PACKED_LAYERS and type(child) is nn.Linear
                  and child.weight.device.type == "cpu" and child.weight.dtype == torch.float32]
    if not candidates or _mkl() is None or not _packs_correctly(candidates[0][2]):
        if candidates:
            log.warning("MKL packed GEMM unavailable: linear layers use plain matmuls")
        return 0
    get_size = _mkl()[0]
    needed = sum(get_size(B_MATRIX, 64, *child.weight.shape) for _, _, child in candidates)
    available = _available_memory()
    if available is not None and needed > available / 2:
        log.warning("packing the weights would take %.1f GiB of the %.1f GiB available: linear layers "
                    "use plain matmuls (slower decode steps)", needed / 2**30, available / 2**30)
        return 0
    for parent, name, child in candidates:
        setattr(parent, name, PackedLinear(child))   # the unpacked weight is released (unless tied)
    return len(candidates)
