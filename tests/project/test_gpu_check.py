"""benchmarks/gpu_check.py where Triton is not installed (a plain `pip install -e .` has none):
the checks of the Triton kernels are skipped with the reason, not reported as errors."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_triton_kernel_checks_are_skipped_where_triton_does_not_import(tmp_path):
    hidden = tmp_path / "no-triton" / "triton"   # first on the path: `import triton` fails as if absent
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text('raise ModuleNotFoundError("No module named \'triton\'", name="triton")\n')
    env = {**os.environ, "PYTHONPATH": str(hidden.parent)}
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--quick",
                           "--only", "environment,paged_decode_kernel,pointwise_kernels"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    lines = {line["check"] if "check" in line else "summary": line
             for line in map(json.loads, done.stdout.splitlines())}
    assert lines["environment"]["triton"] is None, done.stdout
    for check in ("paged_decode_kernel", "pointwise_kernels"):
        assert lines[check]["status"] == "skipped", done.stdout
        assert "Triton does not import" in lines[check]["reason"] and "No module named" in lines[check]["reason"]
    assert (lines["summary"]["error"], lines["summary"]["skipped"]) == (0, 2), done.stdout
    assert done.returncode == 0, done.stdout + done.stderr
