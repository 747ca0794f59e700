"""The hand-written CPU kernels: built on first use with the system C compiler, loaded with
ctypes, and their Python entry points (pipeline/kernels/__init__.py says what each one does).

They are plain C loaded with ctypes: no PyTorch headers, so a build takes about a second,
and ctypes releases the GIL while a kernel runs. The shared library is cached under
`cache_root()/kernels`, keyed by the source, the compiler and the CPU, because it is built
for this CPU (-march=native). Linking OpenMP by its usual soname makes the kernel join the
OpenMP runtime PyTorch has already loaded, so both use the same threads. Where no compiler
works, `available()` is False and callers take their PyTorch path; `PIPELINE_CPU_KERNELS=0`
forces that path. They serve float32 and bfloat16 CPU tensors only.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from pipeline.config import cache_root

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(name)
           for name in ("paged_attention.c", "quantize_rows.c", "rms_norm.c", "rotary_cache.c", "silu_and_mul.c")]
HEADERS = [Path(__file__).with_name("bf16.h")]
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# Tried in order: the fastest build first, then ones that more compilers accept.
FLAG_SETS = (["-O3", "-march=native", "-fopenmp", "-fno-math-errno"], ["-O3", "-fopenmp"], ["-O3"])


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _cpu_fingerprint() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _build(compiler: str) -> Path | None:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([*(src.read_text() for src in SOURCES + HEADERS), compiler, version,
                                    _cpu_fingerprint(), platform.machine()]).encode()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"pipeline-kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    for flags in FLAG_SETS:
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        result = subprocess.run([compiler, *flags, "-shared", "-fPIC", "-o", tmp, *map(str, SOURCES), "-lm"],
                                capture_output=True, text=True)
        if result.returncode == 0:
            os.replace(tmp, target)   # atomic: concurrent workers never load half a file
            return target
        os.unlink(tmp)
        log.info("building the CPU kernels with %s failed: %s", flags, result.stderr)
    return None


@functools.cache   # built and loaded on first use, once per process
def _load():
    if os.environ.get("PIPELINE_CPU_KERNELS", "1") == "0":
        return None
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler found: the CPU kernels are replaced by the slower PyTorch path")
        return None
    try:
        path = _build(compiler)
        if path is None:
            log.warning("%s could not compile the CPU kernels: using the slower PyTorch path", compiler)
            return None
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        log.warning("could not build or load the CPU kernels (%s): using the slower PyTorch path", e)
        return None
    for suffix in ("", "_bf16"):
        attention = getattr(lib, "paged_decode_attention" + suffix)
        attention.restype = ctypes.c_int
        attention.argtypes = ([ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 5
                              + [ctypes.c_int] * 6 + [ctypes.c_float])
        attention8 = getattr(lib, "paged_decode_attention_kv8" + suffix)
        attention8.restype = ctypes.c_int
        attention8.argtypes = attention.argtypes + [ctypes.c_void_p] * 2
        rotary = getattr(lib, "rotary_write_kv" + suffix)
        rotary.restype = None
        rotary.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] + [ctypes.c_int] * 3
        rotary8 = getattr(lib, "rotary_write_kv_int8" + suffix)
        rotary8.restype = None
        rotary8.argtypes = rotary.argtypes + [ctypes.c_void_p] * 2
        silu = getattr(lib, "silu_and_mul" + suffix)
        silu.restype = None
        silu.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
        norm = getattr(lib, "add_rms_norm" + suffix)
        norm.restype = None
        norm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_float]
        quantize = getattr(lib, "quantize_rows_u8" + suffix)
        quantize.restype = None
        quantize.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int32]
        scale_rows = getattr(lib, "scale_rows" + suffix)
        scale_rows.restype = None
        scale_rows.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2
    return lib


def _kernel(name: str, dtype: torch.dtype):
    """The C function for this dtype: float32 `name`, bfloat16 `name_bf16`."""
    return getattr(_load(), name if dtype == torch.float32 else name + "_bf16")


def available() -> bool:
    return _load() is not None


def serves(*tensors: torch.Tensor) -> bool:
    """True when the kernels are built and the tensors are contiguous, on the CPU, and all
    float32 or all bfloat16."""
    dtype = tensors[0].dtype
    if dtype not in KERNEL_DTYPES:
        return False
    for t in tensors:
        if not t.is_cpu or t.dtype != dtype or not t.is_contiguous():
            return False
    return _load() is not None


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """rmsnorm(x) * weight; with a residual, residual += x first (in place) and that is normed."""
    dim = x.shape[-1]
    out = torch.empty_like(x)
    assert weight.dtype == x.dtype and (residual is None or residual.dtype == x.dtype)
    _kernel("add_rms_norm", x.dtype)(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                         out.data_ptr(), x.numel() // dim, dim, eps)
    return out


def quantize_rows_u8(x: torch.Tensor, levels: float, zero_point: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] -> (q [rows, cols] uint8, top [rows, 1] float32): top is each row's largest
    |x| (at least 1e-30, so a zero row gives zero_point); q = rint(x * (levels / top)) +
    zero_point, in 0..255."""
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=torch.uint8)
    top = torch.empty((rows, 1), dtype=torch.float32)
    _kernel("quantize_rows_u8", x.dtype)(x.data_ptr(), q.data_ptr(), top.data_ptr(), rows, cols, levels, zero_point)
    return q, top


def scale_rows(acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor, bias: torch.Tensor | None,
               dtype: torch.dtype) -> torch.Tensor:
    """acc [rows, cols] float32 * row_scale [rows, 1] * col_scale [cols] (+ bias [cols]), all
    float32, in that order, as `dtype` (float32: in place, into acc; bfloat16: a new tensor,
    rounded once)."""
    rows, cols = acc.shape
    for t in (acc, row_scale, col_scale, *(() if bias is None else (bias,))):
        assert t.dtype == torch.float32 and t.is_contiguous()
    assert row_scale.numel() == rows and col_scale.numel() == cols and (bias is None or bias.numel() == cols)
    out = acc if dtype == torch.float32 else torch.empty((rows, cols), dtype=dtype)
    _kernel("scale_rows", dtype)(acc.data_ptr(), row_scale.data_ptr(), col_scale.data_ptr(),
                                 None if bias is None else bias.data_ptr(), out.data_ptr(), rows, cols)
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [tokens, 2 * inter] (gate first) -> silu(gate) * up [tokens, inter]."""
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype)
    _kernel("silu_and_mul", gate_up.dtype)(gate_up.data_ptr(), out.data_ptr(), rows, inter)
    return out


def can_write_kv(qkv: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """rotary_write_kv serves qkv: a float32 or bfloat16 CPU tensor, and a cache of its dtype or int8."""
    return (serves(qkv) and k_cache.is_cpu and k_cache.is_contiguous()
            and k_cache.dtype in (qkv.dtype, torch.int8))


def rotary_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache_rows: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int,
                    k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None) -> None:
    """Rotate q and k of qkv [tokens, (heads + 2 kv_heads) * head_dim] in place by cos/sin
    [tokens, head_dim/2] (float32) and store k and v at cache_rows [tokens * kv_heads] (int64)
    of the layer caches [blocks, kv_heads, block_size, head_dim] (qkv's dtype; or int8, then
    quantized with their scales [blocks, kv_heads, block_size] float32, see layers/quantization/int8_kv_cache.py)."""
    head_dim = k_cache.shape[-1]
    assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim and cos.shape == sin.shape
    assert cache_rows.dtype == torch.int64 and cache_rows.numel() == qkv.shape[0] * num_kv_heads
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
    assert cos.dtype == sin.dtype == torch.float32 and k_cache.dtype == v_cache.dtype
    args = (qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), cache_rows.data_ptr(), k_cache.data_ptr(),
            v_cache.data_ptr(), qkv.shape[0], num_heads, num_kv_heads, head_dim)
    if k_cache.dtype == torch.int8:
        assert k_scales is not None and v_scales is not None
        assert k_scales.dtype == v_scales.dtype == torch.float32 and k_scales.is_contiguous() and v_scales.is_contiguous()
        _kernel("rotary_write_kv_int8", qkv.dtype)(*args, k_scales.data_ptr(), v_scales.data_ptr())
    else:
        assert k_cache.dtype == qkv.dtype
        _kernel("rotary_write_kv", qkv.dtype)(*args)


def can_run_paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """float32 or bfloat16 on the CPU, a cache of q's dtype or int8, head_dim a multiple of 8,
    and the kernel built."""
    return (q.is_cpu and q.dtype in KERNEL_DTYPES and k_cache.dtype in (q.dtype, torch.int8)
            and q.shape[-1] % 8 == 0 and available())


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None, k_scales: torch.Tensor | None = None,
                           v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """q [seqs, heads, head_dim], each sequence's heads contiguous (a row slice of the fused
    q/k projection is fine); caches [blocks, kv_heads, block_size, head_dim] (see
    can_run_paged_decode_attention; int8 ones with their scales [blocks, kv_heads,
    block_size]); block_tables [seqs, max_blocks] and context_lens [seqs] int32. Writes and
    returns out, contiguous [seqs, heads, head_dim]."""
    num_seqs, num_heads, head_dim = q.shape
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    _, num_kv_heads, block_size, _ = k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert block_tables.dtype == context_lens.dtype == torch.int32
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    assert out.is_contiguous() and out.shape == q.shape
    assert v_cache.dtype == k_cache.dtype and q.dtype == out.dtype
    args = (q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
            context_lens.data_ptr(), out.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim,
            block_size, block_tables.shape[1], scale)
    if k_cache.dtype == torch.int8:
        assert k_scales is not None and v_scales is not None
        assert k_scales.dtype == v_scales.dtype == torch.float32 and k_scales.is_contiguous() and v_scales.is_contiguous()
        status = _kernel("paged_decode_attention_kv8", q.dtype)(*args, k_scales.data_ptr(), v_scales.data_ptr())
    else:
        assert k_cache.dtype == q.dtype
        status = _kernel("paged_decode_attention", q.dtype)(*args)
    if status == -1:
        raise MemoryError("paged_decode_attention could not allocate its scratch memory")
    if status != 0:
        raise ValueError(f"paged_decode_attention does not support head_dim {head_dim}")
    return out
