"""The image's CUDA variant and the compose file's GPU node (one worker per GPU), read as
Docker reads them (no Docker engine here): the build argument that picks torch's build, the
services that use it, the profile's command and device reservation, the CMD's entry point,
and the docs' start command."""
from __future__ import annotations

import importlib
import re
import tomllib
from pathlib import Path

import yaml

from test_compose import command_of, resolve

ROOT = Path(__file__).resolve().parents[2]
START = "docker compose --profile gpu up -d worker-gpus"


def services() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


def test_the_image_takes_torch_from_the_index_given_cpu_by_default():
    text = (ROOT / "Dockerfile").read_text()
    (default,) = re.findall(r"^ARG TORCH_INDEX=(\S+)$", text, flags=re.M)
    assert default == "https://download.pytorch.org/whl/cpu"
    runs = re.findall(r"^RUN (.+)$", text, flags=re.M)
    torch_step = next(i for i, r in enumerate(runs) if '--index-url "$TORCH_INDEX" torch' in r)
    project_step = next(i for i, r in enumerate(runs) if 'pip install --no-cache-dir ".[monitoring,gpu]"' in r)
    assert torch_step < project_step   # installed first, so the project's install keeps that build


def test_the_cmd_is_the_pipeline_script_and_its_entry_point_imports():
    cmd = re.search(r"^CMD (\[.+\])$", (ROOT / "Dockerfile").read_text(), flags=re.M)[1]
    program, *args = yaml.safe_load(cmd)
    with open(ROOT / "pyproject.toml", "rb") as f:
        module, _, function = tomllib.load(f)["project"]["scripts"][program].partition(":")
    assert callable(getattr(importlib.import_module(module), function))
    assert resolve(args).name == args[-1]


def test_gpu_workers_run_the_cuda_build():
    workers = services()
    for name in ("worker", "worker-qwen", "worker-gpus"):
        build = workers[name]["build"]
        assert build["context"] == "." and re.fullmatch(r"https://download\.pytorch\.org/whl/cu\d+",
                                                        build["args"]["TORCH_INDEX"]), name
    assert workers["api"]["build"] == workers["migrate"]["build"] == "."   # the CPU image: no GPU there


def test_the_gpu_profile_runs_one_worker_per_gpu_of_the_node():
    gpu_node = services()["worker-gpus"]
    assert gpu_node["profiles"] == ["gpu"]   # not started by a plain `docker compose up`
    command = command_of(gpu_node)
    assert command == ["pipeline", "worker", "--gpus", "all"]
    assert resolve(command[1:]).make_context("worker", command[2:]).params["gpus"] == "all"
    (device,) = gpu_node["deploy"]["resources"]["reservations"]["devices"]
    assert device == {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}
    worker = services()["worker"]
    assert gpu_node["environment"] == worker["environment"] and gpu_node["volumes"] == worker["volumes"]
    assert gpu_node["depends_on"] == worker["depends_on"] and gpu_node["stop_grace_period"] == "2m"


def test_the_docs_give_the_command_that_starts_it():
    assert START in (ROOT / "docker-compose.yml").read_text()
    assert START in (ROOT / "docs" / "gpu.md").read_text()
