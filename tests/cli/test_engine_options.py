"""Engine options through a whole `pipeline run` (or `bench`) job: prefix caching, request
timeouts, an int8 KV cache, speculative decoding and overlapped steps, each giving the
answers it must and recording what it did."""
from __future__ import annotations

import json

import pytest

from jobs.ledger import list_jobs
from jobs.paths import JobPaths
from jobs.results.parquet_files import read_results
from cli import main
from cli_helpers import FAST
from cluster import write_jsonl
import hold


def test_chat_job_with_a_long_system_prompt_computes_it_once(runner, data_root, tiny_model_dir, tmp_path, Session):
    system = "You are a careful assistant who answers in one short sentence. " * 8
    src = write_jsonl(tmp_path / "chat.jsonl", [
        {"id": f"q{i}", "messages": [{"role": "system", "content": system},
                                     {"role": "user", "content": f"What is {i} + {i}?"}],
         "max_tokens": 6, "temperature": 0} for i in range(6)])
    for flag in ("--prefix-caching", "--no-prefix-caching"):
        result = runner.invoke(main, ["run", str(src), "--model", str(tiny_model_dir), "--shard-size", "3",
                                      flag, "--no-reuse", *FAST])   # both computed: the prefix cache is measured
        assert result.exit_code == 0, result.output
    with Session() as s:
        plain, cached = list_jobs(s)                      # newest first
    assert cached.engine_options.get("enable_prefix_caching") is True
    assert plain.engine_options["enable_prefix_caching"] is False
    rows = {job.id: {r["id"]: r for r in read_results(JobPaths(data_root, job.id).results_dir).to_pylist()}
            for job in (cached, plain)}
    assert {k: r["output"] for k, r in rows[cached.id].items()} == {k: r["output"] for k, r in rows[plain.id].items()}
    hits = [rows[cached.id][f"q{i}"]["cached_tokens"] for i in range(6)]
    # The first request computes the system prompt; every later one (the second shard too:
    # one engine serves the whole run) finds its full blocks in the cache.
    assert hits[0] == 0 and hits[1] >= 64 and hits[1] % 16 == 0 and set(hits[1:]) == {hits[1]}
    assert all(r["cached_tokens"] == 0 for r in rows[plain.id].values())
    prompt_tokens = sum(r["prompt_tokens"] for r in rows[cached.id].values())
    assert (cached.cached_tokens, plain.cached_tokens) == (sum(hits), 0)
    assert cached.prefix_hit_rate == pytest.approx(sum(hits) / prompt_tokens)
    assert plain.prefix_hit_rate == 0

def test_request_timeouts_end_long_requests_as_failed_rows_keeping_their_text(runner, data_root, tiny_model_dir,
                                                                             tmp_path, Session):
    """--request-timeout for the job, timeout_s on a line winning over it: the long requests
    end `timeout` with what they had generated, count as failed, and `retry --only-failed`
    would take them; the short ones answer normally. A bad timeout_s names its line. The
    engine holds the long ones four tokens in, their timeouts waiting for the hold, which then
    moves their clocks past them (tests/hold.py): they cannot finish first on a fast machine,
    as they did unheld, nor time out before the hold on a slow one, as they did here."""
    rows = [{"id": "long-job-timeout", "prompt": "Count", "max_tokens": 400, "ignore_eos": True},
            {"id": "long-own-timeout", "prompt": "Count", "max_tokens": 400, "ignore_eos": True, "timeout_s": 0.1},
            {"id": "short", "prompt": "Hi", "max_tokens": 3, "timeout_s": 600}]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    def group(request_id):
        return "long" if request_id.startswith("long-") else request_id

    with hold.installed(prefix="long-", group=group):
        result = runner.invoke(main, ["run", str(src), "--model", str(tiny_model_dir), "--request-timeout", "0.3",
                                      *FAST])
    assert result.exit_code == 0, result.output   # the job ran to the end
    assert "held: long-" in result.output   # they were held before their timeouts
    with Session() as s:
        (job,) = list_jobs(s)
    table = {r["id"]: r for r in read_results(JobPaths(data_root, job.id).results_dir).to_pylist()}
    for rid, after in (("long-job-timeout", "0.3"), ("long-own-timeout", "0.1")):
        row = table[rid]
        assert row["finish_reason"] == "timeout" and row["error"] == f"timed out after {after} s"
        assert 1 <= row["output_tokens"] < 400 and row["output"]
    assert table["short"]["finish_reason"] == "length"
    assert (job.completed_requests, job.failed_requests, job.request_timeout_s) == (1, 2, 0.3)

    bad = write_jsonl(tmp_path / "bad.jsonl", [rows[2], {**rows[2], "id": "x", "timeout_s": -1}])
    refused = runner.invoke(main, ["run", str(bad), "--model", str(tiny_model_dir), *FAST])
    assert refused.exit_code == 2 and "line 2: timeout_s must be a number > 0" in refused.stderr, refused.output


def test_bench_with_an_int8_kv_cache_reports_blocks_and_peak_use(runner, data_root, tiny_model_dir, tmp_path):
    """--kv-cache-dtype is an engine option of every command; bench's JSON line keeps its
    keys and adds the pool's size and its peak use."""
    src = write_jsonl(tmp_path / "w.jsonl", [{"id": str(i), "prompt": f"Count to {i}:", "max_tokens": 4,
                                              "temperature": 0, "ignore_eos": True} for i in range(3)])
    for command in ("run", "submit", "bench"):
        assert "--kv-cache-dtype [auto|int8]" in runner.invoke(main, [command, "--help"]).output, command
    lines = {}
    for kv in ("auto", "int8"):
        result = runner.invoke(main, ["bench", str(src), "--model", str(tiny_model_dir), "--kv-cache-dtype", kv, *FAST])
        assert result.exit_code == 0, result.output
        lines[kv] = json.loads(result.output.strip().splitlines()[-1])
    openai_line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Hi"}}
    refused = runner.invoke(main, ["bench", str(write_jsonl(tmp_path / "openai.jsonl", [openai_line])), *FAST])
    assert refused.exit_code == 2 and 'line 1: no "prompt": bench reads the lines' in refused.output, refused.output
    auto, int8 = lines["auto"], lines["int8"]
    assert {"engine", "requests", "output_tokens", "output_tok_s", "total_tok_s", "prefix_hit_rate"} <= set(int8)
    assert int8["output_tokens"] == auto["output_tokens"] == 12
    assert int8["kv_blocks"] >= 3 * auto["kv_blocks"] > 0      # float32 here: 4 bytes -> 1 + a scale
    assert 0 < int8["kv_peak_utilization"] < auto["kv_peak_utilization"] <= 1


def test_speculative_run_records_drafts_in_results_and_stats(runner, data_root, tmp_path, Session):
    """--speculative ngram through a whole job: the same outputs as without, and the
    drafted/accepted counts in the results Parquet and the job's stats file."""
    import pyarrow.parquet as pq
    text = "Record {}: Alice Moreau, Lyon, 63 units of rubber seals, status partial."
    src = write_jsonl(tmp_path / "copy.jsonl", [  # the bundled model copies; the tiny random one would not
        {"id": f"c{i}", "prompt": f"Text:\n{text.format(i)}\n\nThe same text, copied exactly:\nRecord",
         "max_tokens": 12, "temperature": 0} for i in range(3)])
    outputs = {}
    for flags in ([], ["--speculative", "ngram", "--num-speculative-tokens", "3"]):
        result = runner.invoke(main, ["run", str(src), "--dtype", "float32", *flags, *FAST])
        assert result.exit_code == 0, result.output
        with Session() as s:
            job = list_jobs(s)[0]
        jp = JobPaths(data_root, job.id)
        outputs[bool(flags)] = {r["id"]: r for r in read_results(jp.results_dir).to_pylist()}
        stats = pq.read_table(jp.stats_file).to_pylist()[0]
    plain, spec = outputs[False], outputs[True]
    assert {k: r["output"] for k, r in spec.items()} == {k: r["output"] for k, r in plain.items()}
    assert all(r["draft_tokens"] == r["accepted_tokens"] == 0 for r in plain.values())
    drafted = sum(r["draft_tokens"] for r in spec.values())
    assert drafted > 0 and all(0 <= r["accepted_tokens"] <= r["draft_tokens"] for r in spec.values())
    assert stats["draft_tokens"] == drafted
    assert stats["acceptance_rate"] == pytest.approx(sum(r["accepted_tokens"] for r in spec.values()) / drafted)
    assert (job.draft_tokens, job.acceptance_rate) == (drafted, pytest.approx(stats["acceptance_rate"]))


def test_overlapped_steps_through_a_job_give_the_same_answers(runner, data_root, tiny_model_dir, tmp_path, Session):
    """--overlap-steps (the CUDA default) reaches the engine through `pipeline run`: the same
    greedy outputs, stop strings and lengths as serial steps."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": f"Item {i}: the", "max_tokens": 4 + 3 * i,
                                               "temperature": 0, **({"stop": ["e"]} if i % 2 else {})}
                                              for i in range(6)])
    outputs = []
    for flags in ([], ["--overlap-steps"]):
        result = runner.invoke(main, ["run", str(src), "--model", str(tiny_model_dir), *flags, *FAST])
        assert result.exit_code == 0, result.output
        with Session() as s:
            job = list_jobs(s)[0]
        assert job.engine_options.get("overlap_steps") is (True if flags else None)   # recorded as asked
        rows = read_results(JobPaths(data_root, job.id).results_dir).to_pylist()
        outputs.append({r["id"]: (r["output"], r["finish_reason"], r["output_tokens"]) for r in rows})
    assert len(outputs[1]) == 6 and outputs[1] == outputs[0]
    bench = {}
    for flags in ([], ["--overlap-steps"]):   # bench counts its steps, and those overlapped
        result = runner.invoke(main, ["bench", str(src), "--model", str(tiny_model_dir), *flags, *FAST])
        assert result.exit_code == 0, result.output
        bench[bool(flags)] = json.loads(result.output.strip().splitlines()[-1])
    assert bench[False]["overlapped_steps"] == 0 < bench[False]["steps"]
    assert 0 < bench[True]["overlapped_steps"] < bench[True]["steps"]
