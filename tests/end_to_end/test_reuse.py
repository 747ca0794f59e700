"""Answers reused across jobs (jobs.reuse.stored_answers) through `pipeline run` on the tiny model: a rerun
computes only what changed, every reused row names the job it came from and equals it, and
whatever decides an answer is in the key."""
from __future__ import annotations

import json
import re
from datetime import timedelta

import pytest

from jobs.ledger import get_job, make_engine, session_factory
from jobs.paths import JobPaths, default_database_url
from jobs.results.parquet_files import read_results
from jobs.settings import Settings
from cli import main
from workers import broker
from cluster import TOO_LONG_FOR_TINY

FAST = ["--kv-cache-gib", "0.05", "--device", "cpu"]


def run(runner, tmp_path, lines, model_dir, *args) -> str:
    src = tmp_path / f"in-{len(list(tmp_path.iterdir()))}.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = runner.invoke(main, ["run", str(src), "--model", str(model_dir), *FAST, "--shard-size", "50", *args])
    assert done.exit_code == 0, done.output
    return re.search(r"job (job_[0-9a-f]{16})", done.stdout)[1]


def rows_of(root, job_id) -> dict[str, dict]:
    return {r["id"]: r for r in read_results(JobPaths(root, job_id).results_dir).to_pylist()}


def job_of(root, job_id):
    with session_factory(make_engine(default_database_url(root)))() as s:
        return get_job(s, job_id)


def greedy(i, **kw):
    return {"id": f"q{i:03d}", "prompt": f"Item {i}: describe it", "max_tokens": 4, "temperature": 0, **kw}


def test_a_rerun_with_ten_changed_lines_computes_ten(runner, data_root, tmp_path, tiny_model_dir):
    first = run(runner, tmp_path, [greedy(i) for i in range(200)], tiny_model_dir)
    changed = set(range(0, 200, 20))
    lines = [greedy(i, prompt=f"Item {i}, changed") if i in changed else greedy(i) for i in range(200)]
    second = run(runner, tmp_path, lines, tiny_model_dir)
    before, after = rows_of(data_root, first), rows_of(data_root, second)
    computed = {rid for rid, r in after.items() if r["reused_from"] is None}
    assert computed == {f"q{i:03d}" for i in changed}
    for rid, row in after.items():
        assert row["line"] == int(rid[1:]) + 1 and row["request_key"] and row["engine"]
        if rid not in computed:
            assert row["reused_from"] == first and row["request_key"] == before[rid]["request_key"]
            assert (row["output"], row["output_tokens"], row["worker"]) == (
                before[rid]["output"], before[rid]["output_tokens"], before[rid]["worker"])
    job = job_of(data_root, second)
    assert (job.reused_requests, job.completed_requests) == (190, 200)
    # Throughput counts what this job computed: ten requests' tokens, not two hundred.
    assert job.output_tok_s * job.wall_seconds == pytest.approx(sum(after[r]["output_tokens"] for r in computed))
    # A third run reuses the second's rows, keeping the job that computed them.
    third = rows_of(data_root, run(runner, tmp_path, lines, tiny_model_dir))
    assert {r["reused_from"] for r in third.values()} == {first, second}
    # --no-reuse computes all of it.
    forced = rows_of(data_root, run(runner, tmp_path, lines, tiny_model_dir, "--no-reuse"))
    assert all(r["reused_from"] is None for r in forced.values())


def test_only_deterministic_requests_are_reused_and_every_field_of_the_key_counts(runner, data_root, tmp_path,
                                                                                  tiny_model_dir):
    base = [greedy(0), {"id": "seeded", "prompt": "Hi", "max_tokens": 4, "seed": 7},
            {"id": "unseeded", "prompt": "Hi", "max_tokens": 4}]
    first = run(runner, tmp_path, base, tiny_model_dir)
    again = rows_of(data_root, run(runner, tmp_path, base, tiny_model_dir))
    assert {rid: r["reused_from"] for rid, r in again.items()} == {"q000": first, "seeded": first, "unseeded": None}
    assert rows_of(data_root, first)["unseeded"]["request_key"] is None
    for changed in ({"stop": ["x"]}, {"max_tokens": 5}, {"top_k": 3}, {"messages": [{"role": "user", "content": "Hi"}],
                                                                       "prompt": None}):
        line = {k: v for k, v in {**greedy(0), **changed}.items() if v is not None}
        assert rows_of(data_root, run(runner, tmp_path, [line], tiny_model_dir))["q000"]["reused_from"] is None, changed
    # Another dtype, or the same directory with other weights, is another engine.
    assert rows_of(data_root, run(runner, tmp_path, [greedy(0)], tiny_model_dir, "--dtype", "bfloat16"))[
        "q000"]["reused_from"] is None


def test_other_weights_and_deleted_results_are_computed(runner, data_root, tmp_path, tiny_model_dir,
                                                        other_tiny_model_dir):
    import shutil
    copy = tmp_path / "copy-of-tiny"
    shutil.copytree(tiny_model_dir, copy)
    first = run(runner, tmp_path, [greedy(1)], copy)
    # The same files elsewhere are the same model: the answer is reused.
    assert rows_of(data_root, run(runner, tmp_path, [greedy(1)], tiny_model_dir))["q001"]["reused_from"] == first
    for name in ("model.safetensors",):   # the same directory, other weights
        shutil.copy(other_tiny_model_dir / name, copy / name)
    assert rows_of(data_root, run(runner, tmp_path, [greedy(1)], copy))["q001"]["reused_from"] is None
    # A stored answer whose results are gone is computed, not served.
    job = run(runner, tmp_path, [greedy(2)], tiny_model_dir)
    shutil.rmtree(JobPaths(data_root, job).results_dir)
    assert rows_of(data_root, run(runner, tmp_path, [greedy(2)], tiny_model_dir))["q002"]["reused_from"] is None


def test_gc_deletes_old_results_with_their_index_and_the_next_run_computes(runner, data_root, tmp_path,
                                                                          tiny_model_dir):
    from sqlalchemy import select, update

    from jobs.ledger import Answer, Job
    old = run(runner, tmp_path, [greedy(3), greedy(4)], tiny_model_dir)
    recent = run(runner, tmp_path, [greedy(5)], tiny_model_dir)
    Session = session_factory(make_engine(default_database_url(data_root)))
    with Session() as s:   # the first job ended 40 days ago
        job = s.get(Job, old)
        s.execute(update(Job).where(Job.id == old).values(finished_at=job.finished_at - timedelta(days=40)))
        s.commit()
    done = runner.invoke(main, ["gc", "--older-than", "30d"])
    assert done.exit_code == 0 and done.stdout.split() == [old], done.output
    assert not JobPaths(data_root, old).results_dir.exists() and JobPaths(data_root, recent).results_dir.exists()
    with Session() as s:
        assert set(s.scalars(select(Answer.job_id))) == {recent}
    rerun = rows_of(data_root, run(runner, tmp_path, [greedy(3), greedy(5)], tiny_model_dir))
    assert (rerun["q003"]["reused_from"], rerun["q005"]["reused_from"]) == (None, recent)
    assert runner.invoke(main, ["gc", "--older-than", "soon"]).exit_code == 2


def test_dry_run_counts_match_the_real_run_and_create_nothing(runner, data_root, tmp_path, tiny_model_dir):
    lines = [greedy(i) for i in range(30)] + [{"id": "long", "prompt": TOO_LONG_FOR_TINY, "max_tokens": 4},
                                              {"id": "n3", "prompt": "Hello", "max_tokens": 5, "n": 3, "seed": 1}]
    src = tmp_path / "night.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    dry = [*FAST, "--model", str(tiny_model_dir), "--dry-run", "--json"]
    done = runner.invoke(main, ["submit", str(src), *dry])   # submit needs no broker for a dry run
    assert done.exit_code == 0, done.output
    before = json.loads(done.stdout)
    assert not data_root.exists() or not any(data_root.iterdir())   # no ledger, no job, nothing
    assert (before["lines"], before["rows"], before["over_context"], before["reused"]) == (32, 34, 1, 0)
    assert before["output_token_ceiling"] == 30 * 4 + 4 + 5 * 3 and before["estimated_s"] is None
    first = run(runner, tmp_path, lines, tiny_model_dir)
    rows = read_results(JobPaths(data_root, first).results_dir).to_pylist()
    assert before["prompt_tokens"] == sum(r["prompt_tokens"] for r in rows if r["choice"] == 0)
    assert before["max_prompt_tokens"] == max(r["prompt_tokens"] for r in rows)
    # Once the first job ran: 31 of its answers are stored (the too-long one failed), and it is history.
    after = json.loads(runner.invoke(main, ["run", str(src), *dry]).stdout)
    assert after["reused"] == 31 and after["history_jobs"] == 1
    assert after["estimated_s"] == 0   # nothing left to compute: the too-long one is refused at once
    second = job_of(data_root, run(runner, tmp_path, lines, tiny_model_dir))
    assert second.reused_requests == after["reused"]
    text = runner.invoke(main, ["run", str(src), *FAST, "--model", str(tiny_model_dir), "--dry-run"])
    assert text.exit_code == 0 and "answered from earlier jobs: 31" in text.stdout, text.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "prompt": "x", "temperature": 9}\n')
    refused = runner.invoke(main, ["submit", str(bad), *dry])
    assert refused.exit_code == 2 and "line 1: temperature must be a number between 0 and 2" in refused.output


def test_dry_run_names_a_request_whose_prompt_cannot_be_made(runner, data_root, tmp_path, tiny_model_dir):
    """A tool conversation on a model whose chat template never reads tool_calls (the bundled
    tokenizer's): the dry run counts it and names its line instead of stopping with a traceback;
    the run fails that request alone, for the same reason."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
    lines = [greedy(1), {"id": "tool", "max_tokens": 4, "temperature": 0, "messages": [
        {"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "22C"}]}]
    src = tmp_path / "tools.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = runner.invoke(main, ["submit", str(src), *FAST, "--model", str(tiny_model_dir), "--dry-run", "--json"])
    assert done.exit_code == 0, done.output
    figures = json.loads(done.stdout)
    assert (figures["lines"], figures["untokenizable"]) == (2, 1)
    assert figures["first_untokenizable"].startswith("line 2: this model's chat template does not show")
    rows = rows_of(data_root, run(runner, tmp_path, lines, tiny_model_dir))
    assert rows["q001"]["error"] is None
    assert "chat template does not show an assistant's tool_calls" in rows["tool"]["error"]


def test_two_jobs_of_the_same_lines_at_once_on_two_workers_each_answer_every_id_once(postgres_url, cluster_factory):
    c = cluster_factory(postgres_url)
    lines = [greedy(i, max_tokens=16) for i in range(24)]
    workers = [c.start_worker(), c.start_worker()]
    jobs = [c.submit(lines, shard_size=4), c.submit(lines, shard_size=4)]
    ended = [c.wait_until_ended(job_id) for job_id in jobs]
    assert all(job.status == "completed" and job.completed_requests == 24 for job in ended)
    outputs = []
    for job_id in jobs:
        c.assert_exactly_once(job_id, [line["id"] for line in lines])
        rows = rows_of(c.root, job_id)
        outputs.append({rid: r["output"] for rid, r in rows.items()})
        assert {r["reused_from"] for r in rows.values()} <= {None, *jobs}   # computed, or taken from the other
    assert outputs[0] == outputs[1]
    assert all(p.poll() is None for p in workers)


def test_submit_commits_the_shards_it_can_answer_and_queues_only_the_rest(postgres_url, cluster_factory, tmp_path):
    """`pipeline submit` (the path `pipeline serve` shares): a rerun's shards whose every line
    has a stored answer are committed by the submitter, with no worker running, and only the
    shard with a changed line is queued; an unchanged file's job is completed when submit returns."""
    c = cluster_factory(postgres_url)
    lines = [greedy(i) for i in range(8)]
    said = []

    def submit(rows) -> str:
        src = tmp_path / f"in-{len(list(tmp_path.iterdir()))}.jsonl"
        src.write_text("".join(json.dumps(row) + "\n" for row in rows))
        done = c.cli("submit", str(src), "--model", str(c.model_dir), "--kv-cache-gib", "0.05", "--device", "cpu",
                     "--shard-size", "4")
        assert done.returncode == 0, done.stderr
        said.append(done.stderr)
        return done.stdout.strip()

    worker = c.start_worker()
    first = submit(lines)
    assert c.wait_until_ended(first).status == "completed"
    worker.terminate()
    assert worker.wait(timeout=60) is not None   # from here no worker runs: only the submitter can answer

    mixed = submit([greedy(0, prompt="Item 0, changed"), *lines[1:]])
    shards = {sh.index: sh for sh in c.shards(mixed)}
    assert (shards[0].status, shards[1].status, shards[1].worker) == ("queued", "completed", "submit")
    assert broker.backlog(Settings.from_env(c.env), c.shard_queue) == 1   # shard 0 only

    again = submit(lines)
    job = c.job(again)
    assert (job.status, job.completed_requests, job.reused_requests) == ("completed", 8, 8)
    assert {sh.worker for sh in c.shards(again)} == {"submit"}
    assert "8 of 8 request(s) answered at submit from earlier jobs (all of it" in said[-1], said[-1]
    assert "4 of 8 request(s) answered at submit" in said[-2], said[-2]
    c.assert_exactly_once(again, [line["id"] for line in lines])
    before, after = rows_of(c.root, first), rows_of(c.root, again)
    assert all(after[rid]["reused_from"] == first and after[rid]["output"] == before[rid]["output"]
               and after[rid]["worker"] == before[rid]["worker"] for rid in before)
    assert broker.backlog(Settings.from_env(c.env), c.shard_queue) == 1   # nothing more was queued

    c.start_worker()   # the changed line is computed by a worker, its shard's other lines reused there
    assert c.wait_until_ended(mixed).status == "completed"
    rows = rows_of(c.root, mixed)
    assert {rid for rid, r in rows.items() if r["reused_from"] is None} == {"q000"}
    assert rows["q000"]["worker"] not in (None, "submit")
