"""Result Parquet files and the data-root layout (jobs.results.parquet_files, jobs.paths)."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from types import SimpleNamespace

import duckdb
import pyarrow.compute as pc
import pytest

from jobs import paths
from jobs.results import parquet_files, result_row
from jobs.paths import JobPaths, check_job_id, new_job_id
from jobs.settings import Settings
from jobs.results.parquet_files import (
    RESULT_SCHEMA, export_jsonl, iter_result_rows, read_results, write_shard_tmp,
)
from pipeline.request import FinishReason, RequestOutput, TokenLogprob

JOB = "job_0123456789abcdef"


def result_rows(shard, n, attempt=1):
    return [{"id": f"req-{shard}-{i}", "output": f"héllo {i}", "prompt_tokens": 3, "output_tokens": i,
             "finish_reason": "stop", "error": None, "queue_s": 0.1, "ttft_s": 0.2,
             "latency_s": 1.0 + i, "shard": shard, "attempt": attempt} for i in range(n)]


def commit(jp, shard, rows, attempt=1):
    """Write then publish a shard the way ledger.commit_shard does (tmp + rename)."""
    write_shard_tmp(rows, jp.tmp_result(shard, attempt))
    os.replace(jp.tmp_result(shard, attempt), jp.result_shard(shard))


@pytest.fixture
def jp(data_root):
    return JobPaths(data_root, JOB)


def test_round_trip_keeps_rows_and_schema(jp):
    rows = result_rows(0, 3) + [{"id": "bad", "finish_reason": "error", "error": "boom",
                                 "latency_s": 0.0, "shard": 0, "attempt": 1}]
    commit(jp, 0, rows)
    table = read_results(jp.results_dir)
    assert table.schema == RESULT_SCHEMA
    expected = [{name: row.get(name) for name in RESULT_SCHEMA.names} for row in rows]
    assert table.to_pylist() == expected
    assert read_results(jp.results_dir, columns=["id"]).column_names == ["id"]


def test_the_logprobs_column_holds_openais_chat_entries_of_the_engines_token_logprobs(jp):
    """The engine gives token ids, texts and logprobs; the column holds OpenAI's chat entries of
    them (the text's UTF-8 bytes too), the prompt's first with echo (no logprob, no alternatives)."""
    no = TokenLogprob(2822, "No", -0.5, (TokenLogprob(2822, "No", -0.5), TokenLogprob(6568, "Yes", -1.0)))
    out = RequestOutput(id="r", text="No", token_ids=[2822], finish_reason=FinishReason.STOP, error=None,
                        prompt_tokens=2, output_tokens=1, queue_s=0.0, ttft_s=0.1, latency_s=0.2, logprobs=[no],
                        prompt_logprobs=[TokenLogprob(1, "é", None), TokenLogprob(3, " a", -2.0, ())])
    spec = SimpleNamespace(echo=False, prompt="éa", prompts=None, prompt_index=lambda choice: None, tool_call=None,
                           model=None, encoding_format=None, line=1, key=None)
    entry = {"token": "No", "logprob": -0.5, "bytes": [78, 111],
             "top_logprobs": [{"token": "No", "logprob": -0.5, "bytes": [78, 111]},
                              {"token": "Yes", "logprob": -1.0, "bytes": [89, 101, 115]}]}
    row = result_row.from_output(out, 0, 1, spec)
    assert row["logprobs"] == [entry]
    echoed = result_row.from_output(out, 0, 1, SimpleNamespace(**{**vars(spec), "echo": True}))
    assert echoed["output"] == "éaNo" and echoed["logprobs"] == [
        {"token": "é", "logprob": None, "bytes": [195, 169], "top_logprobs": None},
        {"token": " a", "logprob": -2.0, "bytes": [32, 97], "top_logprobs": []}, entry]
    assert result_row.from_output(dataclasses.replace(out, logprobs=None), 0, 1, spec)["logprobs"] is None
    commit(jp, 0, [row, {**echoed, "id": "e"}])
    assert read_results(jp.results_dir, columns=["logprobs"])["logprobs"].to_pylist() == [
        row["logprobs"], echoed["logprobs"]]


def test_many_shards_are_read_in_groups_of_files_in_shard_order(jp, monkeypatch):
    monkeypatch.setattr(parquet_files, "_FILES_A_SCAN", 2)   # 5 shards: three scans
    for shard in range(5):
        commit(jp, shard, result_rows(shard, shard + 1))
    ids = [f"req-{shard}-{i}" for shard in range(5) for i in range(shard + 1)]
    assert read_results(jp.results_dir)["id"].to_pylist() == ids
    assert [row["id"] for row in iter_result_rows(jp.results_dir, columns=["id"])] == ids
    derived = read_results(jp.results_dir, columns={"id": pc.field("id"), "long": pc.field("output_tokens") > 2})
    assert derived.column_names == ["id", "long"] and derived["long"].to_pylist() == [i > 2 for s in range(5)
                                                                                          for i in range(s + 1)]


def test_unknown_fields_are_refused(jp):
    with pytest.raises(ValueError, match="typo"):
        write_shard_tmp([{"id": "x", "typo": 1}], jp.tmp_result(0, 1))


def test_no_results_gives_an_empty_table(jp):
    assert read_results(jp.results_dir).schema == RESULT_SCHEMA
    assert read_results(jp.results_dir).num_rows == 0
    assert read_results(jp.results_dir, columns=["id", "shard"]).column_names == ["id", "shard"]
    assert list(iter_result_rows(jp.results_dir)) == []


def test_uncommitted_attempts_are_invisible(jp):
    commit(jp, 0, result_rows(0, 2))
    commit(jp, 1, result_rows(1, 3))
    write_shard_tmp(result_rows(2, 5), jp.tmp_result(2, 1))  # a worker mid-shard
    assert read_results(jp.results_dir).num_rows == 5
    assert sum(1 for _ in iter_result_rows(jp.results_dir)) == 5
    [(count,)] = duckdb.sql(f"SELECT count(*) FROM read_parquet('{jp.results_dir}/*.parquet')").fetchall()
    assert count == 5


def test_iter_and_export_jsonl(jp, tmp_path):
    commit(jp, 0, result_rows(0, 2))
    commit(jp, 1, result_rows(1, 1))
    ids = [row["id"] for row in iter_result_rows(jp.results_dir)]
    assert ids == ["req-0-0", "req-0-1", "req-1-0"]
    out = tmp_path / "results.jsonl"
    assert export_jsonl(jp.results_dir, out) == 3
    lines = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [r["id"] for r in lines] == ids and lines[0]["output"] == "héllo 0"
    assert os.listdir(tmp_path).count("results.jsonl") == 1 and not [n for n in os.listdir(tmp_path) if ".tmp" in n]


def test_job_ids():
    job_id = new_job_id()
    assert check_job_id(job_id) == job_id and job_id != new_job_id()
    for bad in ["job_0123456789ABCDEF", "job_0123456789abcde", "job_0123456789abcdef0",
                "job_0123456789abcdef\n", "../job_0123456789abcdef", "job_../../../etc/pw",
                "", None, 7]:
        with pytest.raises(ValueError):
            check_job_id(bad)
        with pytest.raises(ValueError):
            JobPaths(Path("/data"), bad)


def test_job_paths_follow_the_contract(data_root):
    jp = JobPaths(data_root, JOB)
    base = data_root / "jobs" / JOB
    assert jp.dir == base and jp.stats_file == base / "stats.parquet"
    assert jp.input_shard(0) == base / "input" / "shard-00000.jsonl"
    assert jp.result_shard(12) == base / "results" / "shard-00012.parquet"
    assert jp.tmp_dir == base / "results" / "_tmp"
    assert jp.tmp_result(3, 2).parent == jp.tmp_dir
    for bad in (-1, True, "1"):
        with pytest.raises(ValueError):
            jp.result_shard(bad)


def test_job_paths_refuse_a_symlink_out_of_root(data_root, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (data_root / "jobs").mkdir()
    (data_root / "jobs" / JOB).symlink_to(outside)
    with pytest.raises(ValueError, match="escapes"):
        JobPaths(data_root, JOB).results_dir


def test_settings_read_the_environment_once(data_root, monkeypatch, tmp_path):
    monkeypatch.delenv("PIPELINE_DATABASE_URL", raising=False)
    settings = Settings.from_env()
    assert settings.data_dir == data_root
    assert settings.database_url == f"sqlite:///{data_root}/ledger.sqlite"
    assert paths.default_database_url(tmp_path) == f"sqlite:///{tmp_path}/ledger.sqlite"
    monkeypatch.setenv("PIPELINE_DATABASE_URL", "postgresql+psycopg://u@h/db")
    monkeypatch.setenv("PIPELINE_LEASE_SECONDS", "2.5")
    monkeypatch.setenv("PIPELINE_MAX_ATTEMPTS", "")  # empty counts as unset
    settings = Settings.from_env()
    assert settings.database_url == "postgresql+psycopg://u@h/db"
    assert (settings.lease_s, settings.max_attempts) == (2.5, 3)
    monkeypatch.delenv("PIPELINE_DATA_DIR")
    monkeypatch.chdir(tmp_path)
    assert Settings.from_env().data_dir == tmp_path.resolve() / "pipeline-data"
    assert Settings.from_env(data_dir=tmp_path / "x").data_dir == tmp_path / "x"  # an option wins
