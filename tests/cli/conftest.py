"""Fixtures of the CLI tests: a job that `pipeline run` ran to the end."""
from __future__ import annotations

import pytest

from jobs.ledger import list_jobs
from cli import main
from cli_helpers import FAST, requests
from cluster import write_jsonl


@pytest.fixture
def finished_job(runner, data_root, tiny_model_dir, tmp_path, Session):
    """A job run to the end by `pipeline run` (5 requests, one of them failing, 2 shards)."""
    src = write_jsonl(tmp_path / "in.jsonl", requests())
    result = runner.invoke(main, ["run", str(src), "--model", str(tiny_model_dir), "--shard-size", "3", *FAST])
    assert result.exit_code == 0, result.output
    with Session() as s:
        (job,) = list_jobs(s)
    return job.id, result
