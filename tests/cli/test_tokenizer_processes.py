"""PIPELINE_TOKENIZER_PROCESSES: `pipeline run` (the real entry point, so that the spawned
tokenizer processes start from `python -m cli` as a worker's do) answers a file of chats and
raw prompts exactly as it does tokenizing in its own process; the setting takes "auto" (its
default) or a count, and refuses anything else before a job is made."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from cli import main
from jobs.settings import Settings

from jobs.paths import JobPaths
from jobs.results.parquet_files import read_results
from cli_helpers import FAST
from cluster import write_jsonl


def answers(tmp_path, model_dir, src, processes: int) -> dict:
    data = tmp_path / f"data-{processes}"
    # The option for a pool, the setting for none: both reach the engine loop.
    how = (["--tokenizer-processes", str(processes)], {}) if processes else ([], {"PIPELINE_TOKENIZER_PROCESSES": "0"})
    done = subprocess.run([sys.executable, "-m", "cli", "run", str(src), "--model", str(model_dir), *FAST,
                           "--shard-size", "16", *how[0]], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PIPELINE_DATA_DIR": str(data), **how[1]})
    assert done.returncode == 0, done.stderr
    (job_dir,) = (data / "jobs").iterdir()
    rows = read_results(JobPaths(data, job_dir.name).results_dir).to_pylist()
    return {r["id"]: (r["finish_reason"], r["prompt_tokens"], r["output"], r["error"]) for r in rows}


def test_run_with_tokenizer_processes_answers_as_without(tmp_path, tiny_model_dir):
    lines = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"Is review {i} positive?"}],
              "max_tokens": 3, "temperature": 0} for i in range(40)]
    lines += [{"id": f"p{i}", "prompt": "Once upon a time " * (1 + i % 4), "max_tokens": 3, "temperature": 0}
              for i in range(40)]
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    pooled, alone = answers(tmp_path, tiny_model_dir, src, 2), answers(tmp_path, tiny_model_dir, src, 0)
    assert pooled == alone
    assert len(pooled) == 80 and all(reason in ("stop", "length") for reason, *_ in pooled.values())


def test_the_setting_is_auto_or_a_count(tmp_path, monkeypatch):
    monkeypatch.delenv("PIPELINE_TOKENIZER_PROCESSES", raising=False)
    assert Settings.from_env({}).tokenizer_processes == "auto"
    assert Settings.from_env({"PIPELINE_TOKENIZER_PROCESSES": "3"}).tokenizer_processes == 3
    assert Settings.from_env({"PIPELINE_TOKENIZER_PROCESSES": "0"}).tokenizer_processes == 0
    for bad in ("-1", "two", "1.5"):
        with pytest.raises(ValueError, match="PIPELINE_TOKENIZER_PROCESSES"):
            Settings.from_env({"PIPELINE_TOKENIZER_PROCESSES": bad})
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "Hi", "max_tokens": 1}])
    monkeypatch.setenv("PIPELINE_DATA_DIR", str(tmp_path / "data"))
    for how, env in ((["--tokenizer-processes", "many"], {}), ([], {"PIPELINE_TOKENIZER_PROCESSES": "-2"})):
        done = CliRunner().invoke(main, ["run", str(src), *how], env=env)
        assert done.exit_code == 2, done.output
        assert "auto" in done.output
        assert not (tmp_path / "data" / "jobs").exists()
