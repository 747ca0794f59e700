"""Retention: `--keep` (and PIPELINE_KEEP_RESULTS) on the CLI; the recovery pass (`pipeline
recover`, as every worker's recovery thread runs it) deletes the results of jobs past their
keep with their reused-answer index entries, keeping the ledger row with results_expired_at.
On SQLite and PostgreSQL. (The API's expires_after and output_expires_after: tests/api.)"""
from __future__ import annotations

import json
import re
from datetime import timedelta

import pytest
from sqlalchemy import select, update

from cli import main
from jobs.ledger import Answer, Job, get_job, make_engine, session_factory, utcnow
from jobs.paths import JobPaths
from jobs.results.parquet_files import read_results

FAST = ["--kv-cache-gib", "0.05", "--device", "cpu"]


def greedy(i, **kw):
    return {"id": f"q{i:03d}", "prompt": f"Item {i}: describe it", "max_tokens": 4, "temperature": 0, **kw}


@pytest.fixture
def env(db_url, data_root):
    return {"PIPELINE_DATABASE_URL": db_url, "PIPELINE_DATA_DIR": str(data_root), "PIPELINE_KEEP_RESULTS": ""}


@pytest.fixture
def Session(db_url):
    engine = make_engine(db_url)
    yield session_factory(engine)
    engine.dispose()


def run(runner, tmp_path, env, lines, model_dir, *args) -> str:
    src = tmp_path / f"in-{len(list(tmp_path.iterdir()))}.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = runner.invoke(main, ["run", str(src), "--model", str(model_dir), *FAST, *args], env=env)
    assert done.exit_code == 0, done.output
    return re.search(r"job (job_[0-9a-f]{16})", done.stdout)[1]


def reused_from(root, job_id) -> dict[str, str | None]:
    return {r["id"]: r["reused_from"] for r in read_results(JobPaths(root, job_id).results_dir).to_pylist()}


def test_a_job_past_its_keep_loses_its_results_and_index_but_keeps_its_row(runner, env, Session, data_root,
                                                                           tmp_path, tiny_model_dir):
    kept = run(runner, tmp_path, env, [greedy(3), greedy(4)], tiny_model_dir, "--keep", "7d")
    forever = run(runner, tmp_path, env, [greedy(5)], tiny_model_dir)
    with Session() as s:
        job = get_job(s, kept)
        assert (job.keep_seconds, job.results_expired_at, get_job(s, forever).keep_seconds) == (7 * 86400, None, None)
    status = runner.invoke(main, ["status", kept], env=env)
    assert status.exit_code == 0 and "expire" in status.stdout and "(kept 7d)" in status.stdout, status.output

    # Within its keep, the sweep leaves it alone.
    swept = runner.invoke(main, ["recover"], env=env)
    assert swept.exit_code == 0 and json.loads(swept.stdout)["results_expired"] == [], swept.output
    assert JobPaths(data_root, kept).results_dir.exists()

    with Session() as s:   # the job ended eight days ago
        s.execute(update(Job).where(Job.id == kept).values(finished_at=utcnow() - timedelta(days=8)))
        s.commit()
    swept = runner.invoke(main, ["recover"], env=env)
    assert swept.exit_code == 0, swept.output
    assert json.loads(swept.stdout)["results_expired"] == [kept]
    paths = JobPaths(data_root, kept)
    assert not paths.results_dir.exists() and not paths.stats_file.exists()
    assert JobPaths(data_root, forever).results_dir.exists()
    with Session() as s:
        job = get_job(s, kept)
        assert job.results_expired_at is not None and job.completed_requests == 2   # the row and its counts stay
        assert set(s.scalars(select(Answer.job_id))) == {forever}
    # Once only: a second pass finds nothing to do.
    assert json.loads(runner.invoke(main, ["recover"], env=env).stdout)["results_expired"] == []

    # Its answers are computed again; the kept job's are still reused.
    rerun = run(runner, tmp_path, env, [greedy(3), greedy(5)], tiny_model_dir)
    assert reused_from(data_root, rerun) == {"q003": None, "q005": forever}
    status = runner.invoke(main, ["status", kept], env=env)
    assert "results" in status.stdout and "expired" in status.stdout, status.output
    results = runner.invoke(main, ["results", kept], env=env)
    assert results.exit_code == 1 and "expired" in results.output
    retry = runner.invoke(main, ["retry", kept, "--local"], env=env)
    assert retry.exit_code != 0 and "expired" in retry.output


def test_the_keep_comes_from_the_setting_and_bad_keeps_are_usage_errors(runner, env, Session, tmp_path,
                                                                          tiny_model_dir):
    job_id = run(runner, tmp_path, {**env, "PIPELINE_KEEP_RESULTS": "12h"}, [greedy(1)], tiny_model_dir)
    overridden = run(runner, tmp_path, {**env, "PIPELINE_KEEP_RESULTS": "12h"}, [greedy(2)], tiny_model_dir,
                     "--keep", "30m")
    with Session() as s:
        assert (get_job(s, job_id).keep_seconds, get_job(s, overridden).keep_seconds) == (12 * 3600, 1800)
    src = tmp_path / "one.jsonl"
    src.write_text(json.dumps(greedy(0)) + "\n")
    for bad in ("7", "0d", "7 d", "-1h", "36501d", "a week"):
        for command in ("run", "submit"):
            done = runner.invoke(main, [command, str(src), "--keep", bad], env=env)
            assert done.exit_code == 2 and "--keep" in done.output, (command, bad, done.output)
    bad_setting = runner.invoke(main, ["run", str(src)], env={**env, "PIPELINE_KEEP_RESULTS": "a week"})
    assert bad_setting.exit_code == 2 and "PIPELINE_KEEP_RESULTS" in bad_setting.output, bad_setting.output
    with Session() as s:
        assert len(list(s.scalars(select(Job.id)))) == 2   # nothing made by the refused ones
