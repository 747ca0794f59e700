"""Compile our Triton kernels ahead of time for Ampere and Hopper, without a GPU; one JSON
line per variant ({"variant", "error", "registers", "stack_bytes"}: the last two read off
the cubin by the cuobjdump Triton's wheel bundles; stack bytes are register spills). Run
as a script by tests/layers/test_triton_compiles.py
in a process of its own: a process where TRITON_INTERPRET was set when Triton was first
imported has interpreted versions of Triton's own library functions, which the compiler
cannot take.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

TARGETS = (80, 90)   # sm_80 (A100), sm_90 (H100, H200)
# Kernels for some GPUs only: float8 conversions need sm_89 (fp8 quantization refuses older GPUs).
ONLY_ON = {"quantize_fp8_rows": (90,), "fp8_matmul": (90,)}
SHAPES = {"smollm2-135m": (9, 3, 64, 576, 1536), "llama-3.2-1b": (32, 8, 64, 2048, 8192),   # heads, kv, dim,
          "llama-3.1-8b": (32, 8, 128, 4096, 14336)}                                         # hidden, mlp


# Integer arguments that are multiples of 16 at every launch for these shapes (strides of
# head_dim-sized rows): Triton's JIT marks such an argument divisible by 16 when it
# specializes a launch (and every tensor's pointer, being 16-byte aligned), which lets the
# compiler vectorize loads; the compile here marks the same, so its registers are the launch's.
DIVISIBLE = {"_paged_decode_kernel": {"stride_q_tok", "stride_q_head", "stride_k_block", "stride_k_slot",
                                      "stride_k_head", "stride_v_block", "stride_v_slot", "stride_v_head",
                                      "stride_out_tok", "stride_out_head", "stride_out_split"},
             "_add_rms_norm_kernel": {"dim"}, "_silu_and_mul_kernel": {"inter"},
             "_rotary_write_kv_kernel": {"stride_qkv"}, "_quantize_fp8_rows_kernel": {"cols", "out_cols", "stride_x"},
             "_fp8_matmul_kernel": {"N", "K", "stride_x", "stride_w", "stride_out"}}


def targets(variant: str) -> tuple[int, ...]:
    """The architectures a variant is compiled for."""
    return ONLY_ON.get(variant.split("/")[0], TARGETS)


def variants():
    """(name, kernel attribute, pointer and scalar types, constexprs, options) of every
    variant an engine launches for these shapes, with the constants the launches compute."""
    from pipeline.kernels import fp8_matmul_triton as fp8mm
    from pipeline.kernels import paged_decode_triton as decode
    from pipeline.kernels import pointwise_triton as pointwise

    for rows, launch in fp8mm.LAUNCHES.items():   # the same kernel for every model: its launches
        for out in ("bf16", "fp16"):
            yield (f"fp8_matmul/rows{rows}/{out}", "fp8_matmul_triton._fp8_matmul_kernel",
                   dict(x_ptr="*fp8e4nv", w_ptr="*fp8e4nv", x_scale_ptr="*fp32", w_scale_ptr="*fp32",
                        out_ptr=f"*{out}"),
                   dict(BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, EVEN_K=True),
                   dict(num_warps=launch.num_warps, num_stages=launch.num_stages))

    for model, (heads, kv_heads, head_dim, hidden, inter) in SHAPES.items():
        for dtype in ("bf16", "fp16"):
            for splits in (1, 8):   # a batch that fills the GPU; a small one split across SMs
                yield (f"paged_decode/{model}/{dtype}/splits{splits}", "paged_decode_triton._paged_decode_kernel",
                       dict(q_ptr=f"*{dtype}", k_ptr=f"*{dtype}", v_ptr=f"*{dtype}",
                            out_ptr=f"*{dtype}" if splits == 1 else "*fp32", lse_ptr="*fp32",
                            block_table_ptr="*i32", seqused_ptr="*i32", scale="fp32"),
                       dict(**decode.tile_shape(heads, kv_heads, head_dim), PAGE=16, SPLITS=splits),
                       decode.launch_options())
        for dtype in ("bf16", "fp32"):
            t = f"*{dtype}"
            block, warps = pointwise.norm_launch(hidden)
            for residual in (True, False):
                yield (f"add_rms_norm/{model}/{dtype}/residual{int(residual)}", "pointwise_triton._add_rms_norm_kernel",
                       dict(x_ptr=t, residual_ptr=t, weight_ptr=t, out_ptr=t, eps="fp32"),
                       dict(HAS_RESIDUAL=residual, BLOCK=block), dict(num_warps=warps))
            yield (f"silu_and_mul/{model}/{dtype}", "pointwise_triton._silu_and_mul_kernel",
                   dict(gate_up_ptr=t, out_ptr=t), dict(BLOCK=pointwise.silu_block(inter)), {})
            yield (f"rotary_write_kv/{model}/{dtype}", "pointwise_triton._rotary_write_kv_kernel",
                   dict(qkv_ptr=t, cos_ptr="*fp32", sin_ptr="*fp32", slot_ptr="*i64", k_cache_ptr=t, v_cache_ptr=t),
                   pointwise.rotary_shape(heads, kv_heads, head_dim), {})
            for width in (hidden, inter):   # the inputs of qkv/gate_up and of down_proj
                block, warps = pointwise.norm_launch(width)
                yield (f"quantize_fp8_rows/{model}/{dtype}/{width}", "pointwise_triton._quantize_fp8_rows_kernel",
                       dict(x_ptr=t, out_ptr="*fp8e4nv", scale_ptr="*fp32", min_amax="fp32", fp8_max="fp32",
                            inv_fp8_max="fp32"),
                       dict(BLOCK=block), dict(num_warps=warps))


def main() -> None:
    assert not os.environ.get("TRITON_INTERPRET") in ("1", "true"), "run without TRITON_INTERPRET"
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for name, where, types, constexprs, options in variants():
        module, attribute = where.split(".")
        kernel = getattr(importlib.import_module(f"pipeline.kernels.{module}"), attribute)
        signature = {arg: "constexpr" if arg in constexprs else types.get(arg, "i32") for arg in kernel.arg_names}
        divisible = DIVISIBLE[kernel.fn.__name__]
        attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(kernel.arg_names)
                 if signature[arg].startswith("*") or arg in divisible}
        for arch in targets(name):
            usage = {}
            try:
                compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs),
                                          target=GPUTarget("cuda", arch, 32), options=options or None)
                error = None if compiled.asm.get("cubin") else "no cubin"
                usage = resource_usage(compiled.asm["cubin"]) if error is None else {}
            except Exception as e:   # what a first launch on that GPU would raise
                error = f"{type(e).__name__}: {e}"[:2000]
            print(json.dumps({"variant": f"{name}/sm_{arch}", "error": error, **usage}), flush=True)


def resource_usage(cubin: bytes) -> dict:
    """Registers per thread and stack bytes (spills) of a cubin's kernel."""
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", text)
    return {"registers": int(found[1]), "stack_bytes": int(found[2])}


if __name__ == "__main__":
    sys.exit(main())
