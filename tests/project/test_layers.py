"""The import contracts of pyproject.toml ([tool.importlinter]) hold, and really bite.

cli -> api -> workers -> jobs -> pipeline (the engine) with no exception, the engine imports
nothing of jobs, workers, the CLI, Celery, SQL or Parquet, and jobs nothing of workers or Celery.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("cli", "api", "workers", "jobs", "pipeline", "migrations")
LINT = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"


def lint(root: Path) -> subprocess.CompletedProcess:
    """lint-imports on the tree at root (its pyproject.toml, its packages first on the path)."""
    return subprocess.run([sys.executable, "-c", LINT], cwd=root, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})


def test_the_layers_hold():
    done = lint(ROOT)
    assert done.returncode == 0 and "0 broken" in done.stdout, done.stdout + done.stderr


def test_imports_against_the_layers_break_their_contracts(tmp_path):
    for name in PACKAGES:
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    paths = tmp_path / "jobs" / "paths.py"
    paths.write_text(paths.read_text() + "\nimport workers.broker  # noqa\n")
    sampling = tmp_path / "pipeline" / "sampling_params.py"
    sampling.write_text(sampling.read_text() + "\nimport sqlalchemy  # noqa\n")
    done = lint(tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Jobs know nothing of workers, the API, Celery or the CLI BROKEN" in done.stdout
    assert "Top-down: cli, api, workers, jobs, then the engine; never the other way BROKEN" in done.stdout
    assert "The engine knows nothing of jobs, workers, the CLI, Celery, SQL or Parquet BROKEN" in done.stdout
    assert "Nothing imports the CLI KEPT" in done.stdout
