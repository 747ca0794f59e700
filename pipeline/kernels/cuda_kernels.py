"""Which Triton kernel serves a CUDA step, imported only there: each function returns the
kernel module where it serves the tensors (on CUDA, Triton importing, its probe passed on
that device), else None, and the caller takes its PyTorch path."""
from __future__ import annotations

import torch


def triton_pointwise(*tensors: torch.Tensor):
    """pointwise_triton (the fused elementwise kernels for CUDA) where they serve these
    tensors, else None: off CUDA, without Triton, or where its probe failed."""
    if not tensors[0].is_cuda:
        return None
    try:
        from pipeline.kernels import pointwise_triton
    except ImportError:   # no Triton
        return None
    return pointwise_triton if pointwise_triton.serves(*tensors) else None


def triton_fp8_rows(x: torch.Tensor):
    """pointwise_triton where its fp8 row quantization serves x (a CUDA tensor of a float
    dtype, Triton imports, its probe passed on that device), else None."""
    if not x.is_cuda:
        return None
    try:
        from pipeline.kernels import pointwise_triton
    except ImportError:   # no Triton
        return None
    return pointwise_triton if x.dtype in pointwise_triton.DTYPES and pointwise_triton.fp8_usable(x.device) else None


def triton_fp8_matmul(x8: torch.Tensor):
    """fp8_matmul_triton where its product serves x8 (float8 activations on CUDA, rows within
    its MAX_ROWS, Triton imports, its probe passed on that device), else None."""
    if not x8.is_cuda:
        return None
    try:
        from pipeline.kernels import fp8_matmul_triton
    except ImportError:   # no Triton
        return None
    return fp8_matmul_triton if fp8_matmul_triton.serves(x8.shape[0]) and fp8_matmul_triton.usable(x8.device) else None
