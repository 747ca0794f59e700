"""Our Triton kernels compile for the GPUs we serve, here, without one.

The interpreter that runs them in the other tests executes the Python, so it accepts what
Triton's compiler refuses (a shape tl.dot cannot take, a type that does not promote, a
loop the compiler cannot lower). So every kernel is also compiled ahead of time, through
PTX to a cubin with the ptxas that the Triton wheel bundles, for Ampere (sm_80) and Hopper
(sm_90, the H200), at the variants an engine launches for SmolLM2-135M, a Llama-3.2-1B
and a Llama-3.1-8B shape (tests/triton_compile_check.py, in a process without the
interpreter), with the divisibility a launch's specialization gives its arguments: a
kernel that would fail its first launch on such a GPU fails here, and so does one that
spills registers to the stack. (The float8 quantization kernel compiles for Hopper only.)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from triton_compile_check import targets, variants

TESTS = Path(__file__).resolve().parent.parent
VARIANTS = [f"{name}/sm_{arch}" for name, *_ in variants() for arch in targets(name)]


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_DEFAULT_FP_FUSION="1", PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]))
    done = subprocess.run([sys.executable, str(TESTS / "triton_compile_check.py")], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {line["variant"]: line for line in map(json.loads, done.stdout.splitlines())}


@pytest.mark.parametrize("variant", VARIANTS)
def test_kernel_compiles_without_spilling(compiled, variant):
    """Compiles, and keeps its registers: a spill (stack bytes) is a slow kernel."""
    assert variant in compiled, sorted(compiled)
    result = compiled[variant]
    assert result["error"] is None, result["error"]
    assert result["stack_bytes"] == 0, result
