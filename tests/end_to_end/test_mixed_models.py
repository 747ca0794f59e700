"""A job of several models (issue 53, item 4): `--model A --model B`, each line naming its model
(body.model in OpenAI lines, `model` in ours). Through the real CLI: `pipeline submit --wait` with
real Redis and a real worker serving both models, `pipeline run`, bad lines, the dry run, a one-model
job's rows left as they were, and migration 0017, on SQLite and PostgreSQL."""
from __future__ import annotations

import json
import re

import pyarrow.parquet as pq
import pytest

from cli import main
from cli_helpers import FAST
from cluster import write_jsonl
from jobs.ledger import get_job, get_shards, list_jobs, make_engine, session_factory, upgrade
from jobs.paths import JobPaths
from ledger_helpers import the_job_and_its_shards
from jobs.reuse.answer_key import engine_fingerprint
from jobs.several_models import SeveralEngines
from pipeline.engine_key import engine_key


def _rows(a_dir, b_dir) -> list[dict]:
    """Seven lines, the two models interleaved: A by its path, B by its directory's name, both formats."""
    rows = []
    for i in range(7):
        model = str(a_dir) if i % 2 == 0 else b_dir.name
        if i < 4:
            rows.append({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": model, "messages": [{"role": "user", "content": f"Say {i}"}],
                                  "max_tokens": 3, "temperature": 0}})
        else:
            rows.append({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": model, "messages": [{"role": "user", "content": f"Tell {i}"}],
                                  "max_tokens": 2 + i % 2, "temperature": 0}})
    return rows


def _a_ids():
    return {f"r{i}" for i in range(7) if i % 2 == 0}


def _models(a_dir, b_dir):
    return ["--model", str(a_dir), "--model", str(b_dir)]



def _check_the_job(job, shards, root, a_dir, b_dir):
    """Every id once, each row computed by its line's model, the ledger's rows and figures per model."""
    keys = [engine_key({"model": str(d)}) for d in (a_dir, b_dir)]
    fingerprints = [engine_fingerprint({"model": str(d), "kv_cache_gib": 0.05, "device": "cpu"}) for d in (a_dir, b_dir)]
    assert job.status == "completed"
    assert [m["model"] for m in job.models] == [str(a_dir), str(b_dir)]
    assert [m["engine_key"] for m in job.models] == keys
    assert [m["engine_fingerprint"] for m in job.models] == fingerprints
    assert (job.model, job.engine_key, job.engine_fingerprint) == (str(a_dir), keys[0], fingerprints[0])
    # each shard one model's lines (shard size 2: A's 4 lines in 2 shards, then B's 3 in 2)
    assert [sh.engine_key for sh in shards] == [keys[0]] * 2 + [keys[1]] * 2
    assert [sh.engine_fingerprint for sh in shards] == [fingerprints[0]] * 2 + [fingerprints[1]] * 2
    assert [sh.engine_options["model"] for sh in shards] == [str(a_dir)] * 2 + [str(b_dir)] * 2
    assert [sh.num_requests for sh in shards] == [2, 2, 2, 1]
    rows = pq.read_table(JobPaths(root, job.id).results_dir).to_pylist()
    assert sorted(r["id"] for r in rows) == [f"r{i}" for i in range(7)]   # every id exactly once
    for r in rows:
        assert r["finish_reason"] in ("stop", "length"), r
        assert r["engine"] == fingerprints[0 if r["id"] in _a_ids() else 1], r
    a_rows = [r for r in rows if r["id"] in _a_ids()]
    b_rows = [r for r in rows if r["id"] not in _a_ids()]
    for m, mine in zip(job.models, (a_rows, b_rows)):
        assert (m["total_requests"], m["completed_requests"], m["failed_requests"]) == (len(mine), len(mine), 0)
        assert m["prompt_tokens"] == sum(r["prompt_tokens"] for r in mine)
        assert m["output_tokens"] == sum(r["output_tokens"] for r in mine)
    assert job.completed_requests == 7 and job.output_tokens == sum(r["output_tokens"] for r in rows)


def test_submit_wait_runs_each_models_lines_on_its_engine_of_a_worker_serving_both(
        db_url, cluster_factory, tmp_path, tiny_model_dir, other_tiny_model_dir):
    c = cluster_factory(db_url)
    fast = ["--kv-cache-gib", "0.05", "--device", "cpu"]
    worker = c.start_worker(args=[*_models(tiny_model_dir, other_tiny_model_dir), *fast], PIPELINE_WORKER_ENGINES="")
    src = write_jsonl(tmp_path / "mixed.jsonl", _rows(tiny_model_dir, other_tiny_model_dir))
    c.wait_for("the worker to start", lambda: "engine " in c.log(worker) and " loaded" in c.log(worker), timeout=120)
    done = c.cli("submit", str(src), *_models(tiny_model_dir, other_tiny_model_dir), *fast, "--shard-size", "2",
                 "--wait")
    assert done.returncode == 0, done.stderr
    assert "no live worker" not in done.stderr
    job_id = done.stdout.strip().splitlines()[0]
    job, shards = c.job(job_id), c.shards(job_id)
    _check_the_job(job, shards, c.root, tiny_model_dir, other_tiny_model_dir)
    c.assert_exactly_once(job_id, [f"r{i}" for i in range(7)])
    c.env["COLUMNS"] = "500"   # status lines unwrapped
    status = c.cli("status", job_id)
    assert status.returncode == 0, status.stderr
    text = re.sub(r" +", " ", status.stdout)
    for m in job.models:
        assert (f"model {m['model']} │ {m['completed_requests']} completed, 0 failed, {m['total_requests']} total; "
                f"{m['prompt_tokens']} prompt, {m['output_tokens']} output tokens") in text, text


def test_submit_warns_per_model_when_no_worker_serves_it_naming_its_lines(
        sqlite_url, cluster_factory, tmp_path, tiny_model_dir, other_tiny_model_dir):
    c = cluster_factory(sqlite_url)
    src = write_jsonl(tmp_path / "mixed.jsonl", _rows(tiny_model_dir, other_tiny_model_dir))
    done = c.cli("submit", str(src), *_models(tiny_model_dir, other_tiny_model_dir), "--kv-cache-gib", "0.05",
                 "--device", "cpu", "--shard-size", "2")
    assert done.returncode == 0, done.stderr
    assert f"no live worker serves model {tiny_model_dir} (engine " in done.stderr
    assert "its lines 1, 3, 5, 7)" in done.stderr
    assert f"no live worker serves model {other_tiny_model_dir} (engine " in done.stderr
    assert "its lines 2, 4, 6)" in done.stderr
    status = c.cli("status", done.stdout.strip())   # the per-model warning is the word: no job-wide guess
    assert status.returncode == 0 and "waiting for a worker" not in status.stdout, status.stdout


def test_pipeline_run_runs_one_models_shards_then_the_others(runner, db_url, data_root, tmp_path, tiny_model_dir,
                                                              other_tiny_model_dir):
    src = write_jsonl(tmp_path / "mixed.jsonl", _rows(tiny_model_dir, other_tiny_model_dir))
    result = runner.invoke(main, ["run", str(src), *_models(tiny_model_dir, other_tiny_model_dir), *FAST,
                                  "--shard-size", "2", "--database-url", db_url])
    assert result.exit_code == 0, result.output
    job, shards = the_job_and_its_shards(db_url)
    _check_the_job(job, shards, data_root, tiny_model_dir, other_tiny_model_dir)


def test_a_line_naming_no_model_or_another_is_refused_with_its_line_number(runner, db_url, data_root, tmp_path,
                                                                          tiny_model_dir, other_tiny_model_dir):
    rows = _rows(tiny_model_dir, other_tiny_model_dir)
    rows[2]["body"]["model"] = "gpt-4o-mini"
    del rows[5]["body"]["model"]
    src = write_jsonl(tmp_path / "bad.jsonl", rows)
    for command in ("submit", "run"):
        result = runner.invoke(main, [command, str(src), *_models(tiny_model_dir, other_tiny_model_dir), *FAST,
                                      "--database-url", db_url])
        assert result.exit_code == 2, result.output
        assert "line 3: the line names the model 'gpt-4o-mini', not one of the job's" in result.output
        assert "line 6: the line names no model; a job of several models needs each line to name one of" in result.output
        assert "line 1" not in result.output
    pipeline_rows = [{"id": "p1", "prompt": "Hi", "model": tiny_model_dir.name},
                     {"id": "p2", "prompt": "Hi"}]
    src = write_jsonl(tmp_path / "bad-pipeline.jsonl", pipeline_rows)
    result = runner.invoke(main, ["run", str(src), *_models(tiny_model_dir, other_tiny_model_dir), *FAST,
                                  "--database-url", db_url])
    assert result.exit_code == 2 and "line 2: the line names no model" in result.output, result.output
    engine = make_engine(db_url)
    try:
        with session_factory(engine)() as s:
            assert list_jobs(s) == []   # nothing was created
    finally:
        engine.dispose()
    assert not (data_root / "jobs").exists()


def test_our_format_names_the_model_in_its_model_field(runner, sqlite_url, data_root, tmp_path, tiny_model_dir,
                                                       other_tiny_model_dir):
    rows = [{"id": f"p{i}", "prompt": f"Count {i}", "max_tokens": 2, "temperature": 0,
             "model": (tiny_model_dir if i % 2 else other_tiny_model_dir).name} for i in range(4)]
    src = write_jsonl(tmp_path / "ours.jsonl", rows)
    result = runner.invoke(main, ["run", str(src), *_models(tiny_model_dir, other_tiny_model_dir), *FAST,
                                  "--database-url", sqlite_url])
    assert result.exit_code == 0, result.output
    job, shards = the_job_and_its_shards(sqlite_url)
    by_id = {r["id"]: r for r in pq.read_table(JobPaths(data_root, job.id).results_dir).to_pylist()}
    assert by_id["p1"]["engine"] == job.models[0]["engine_fingerprint"]
    assert by_id["p0"]["engine"] == job.models[1]["engine_fingerprint"]
    assert by_id["p0"]["model"] == other_tiny_model_dir.name


def test_the_dry_run_counts_per_model(runner, sqlite_url, data_root, tmp_path, tiny_model_dir, other_tiny_model_dir):
    src = write_jsonl(tmp_path / "mixed.jsonl", _rows(tiny_model_dir, other_tiny_model_dir))
    result = runner.invoke(main, ["submit", str(src), *_models(tiny_model_dir, other_tiny_model_dir), *FAST,
                                  "--dry-run", "--json", "--database-url", sqlite_url])
    assert result.exit_code == 0, result.output
    models = json.loads(result.stdout)["models"]
    assert [(m["model"], m["lines"]) for m in models] == [(str(tiny_model_dir), 4), (str(other_tiny_model_dir), 3)]
    assert [m["engine_key"] for m in models] == [engine_key({"model": str(d), "kv_cache_gib": 0.05, "device": "cpu"})
                                                  for d in (tiny_model_dir, other_tiny_model_dir)]
    assert [m["output_token_ceiling"] for m in models] == [3 + 3 + 2 + 2, 3 + 3 + 3]
    text = runner.invoke(main, ["submit", str(src), *_models(tiny_model_dir, other_tiny_model_dir), *FAST,
                                "--dry-run", "--database-url", sqlite_url])
    assert text.exit_code == 0, text.output
    assert f"model {tiny_model_dir}:\n  requests: 4 (4 result rows)" in text.stdout
    assert f"model {other_tiny_model_dir}:\n  requests: 3 (3 result rows)" in text.stdout


def test_a_served_name_not_naming_its_model_or_one_model_twice_are_refused(runner, sqlite_url, tmp_path,
                                                                            tiny_model_dir, other_tiny_model_dir):
    src = write_jsonl(tmp_path / "mixed.jsonl", _rows(tiny_model_dir, other_tiny_model_dir))
    for name in ("gpt-4o-mini", "gpt-4o-mini=nowhere"):
        served = runner.invoke(main, ["run", str(src), *_models(tiny_model_dir, other_tiny_model_dir), *FAST,
                                      "--served-model-name", name, "--database-url", sqlite_url])
        assert served.exit_code == 2 and "a job of several models takes NAME=MODEL" in served.output, served.output
    twice = runner.invoke(main, ["run", str(src), *_models(tiny_model_dir, tiny_model_dir), *FAST,
                                 "--database-url", sqlite_url])
    assert twice.exit_code == 2 and "--model names the same model twice" in twice.output, twice.output


def test_a_one_model_jobs_rows_keep_their_nulls(runner, db_url, data_root, tmp_path, tiny_model_dir):
    rows = [{"id": f"p{i}", "prompt": f"Count {i}", "max_tokens": 2, "temperature": 0} for i in range(3)]
    src = write_jsonl(tmp_path / "one.jsonl", rows)
    result = runner.invoke(main, ["run", str(src), "--model", str(tiny_model_dir), *FAST, "--shard-size", "2",
                                  "--database-url", db_url])
    assert result.exit_code == 0, result.output
    job, shards = the_job_and_its_shards(db_url)
    assert job.status == "completed" and job.models is None
    assert [(sh.engine_key, sh.engine_options, sh.engine_fingerprint) for sh in shards] == [(None, None, None)] * 2
    status = runner.invoke(main, ["status", job.id, "--database-url", db_url])
    assert status.exit_code == 0 and f"model {tiny_model_dir} │" not in status.output


def test_migration_0017_goes_down_and_up_keeping_the_jobs(db_url, ledger):
    from ledger_helpers import downgraded_schema, make_job

    _, Session = ledger
    job_id = make_job(Session)
    schema = downgraded_schema(db_url, "0016")
    assert "models" not in schema["jobs"]
    assert not {"engine_key", "engine_options", "engine_fingerprint"} & schema["shards"]
    upgrade(db_url)
    with Session() as s:
        assert get_job(s, job_id).models is None
        assert all((sh.engine_key, sh.engine_options, sh.engine_fingerprint) == (None, None, None)
                   for sh in get_shards(s, job_id))


def test_recovery_sends_each_shard_back_to_its_own_models_queue(db_url, data_root, tmp_path, tiny_model_dir,
                                                                  other_tiny_model_dir):
    """The reconciler re-sends a lost shard on its model's queue (only where that queue is empty),
    the reaper a dead worker's shard on its model's queue: never the job's first model's for all."""
    from datetime import timedelta

    from sqlalchemy import update

    from jobs.ledger import Job, Shard, claim_shard, utcnow
    from jobs.submission import create_job_from_file
    from workers.recovery import recover

    a_key, b_key = (engine_key({"model": str(d)}) for d in (tiny_model_dir, other_tiny_model_dir))
    engine = make_engine(db_url)
    Session = session_factory(engine)
    sent: list[tuple[str, tuple[str, int]]] = []
    busy = {b_key}   # B's queue has messages waiting: its shards are not lost
    pass_ = dict(max_attempts=3, queued_grace_s=5,
                 enqueue=lambda route, shards: sent.extend((route.engine_key, shard) for shard in shards),
                 backlog=lambda route: int(route.engine_key in busy))
    try:
        src = write_jsonl(tmp_path / "mixed.jsonl", _rows(tiny_model_dir, other_tiny_model_dir))
        models = [(str(d), {"model": str(d)}) for d in (tiny_model_dir, other_tiny_model_dir)]
        job_id = create_job_from_file(Session, data_root, src, model=str(tiny_model_dir), engine_options={},
                                      shard_size=2, models=models, queue="pipeline")[0]
        past = utcnow() - timedelta(seconds=60)
        with Session() as s:
            assert [sh.engine_key for sh in get_shards(s, job_id)] == [a_key, a_key, b_key, b_key]
            s.execute(update(Job).where(Job.id == job_id).values(created_at=past))
            s.commit()
        report = recover(Session, data_root, **pass_)
        assert sorted(report["reenqueued"]) == [(job_id, 0), (job_id, 1)]
        assert sorted(sent) == [(a_key, (job_id, 0)), (a_key, (job_id, 1))]
        sent.clear()
        with Session() as s:   # B's worker took shard 3 and died
            assert claim_shard(s, job_id, 3, "dead-worker:1", 60, 3) == 1
            s.execute(update(Shard).where(Shard.job_id == job_id, Shard.index == 3).values(lease_expires_at=past))
            s.commit()
        report = recover(Session, data_root, **pass_)
        assert report["requeued"] == [(job_id, 3)] and sent == [(b_key, (job_id, 3))]
    finally:
        engine.dispose()


def test_a_retry_of_a_several_model_job_runs_each_line_on_its_model_again(runner, sqlite_url, data_root, tmp_path,
                                                                         tiny_model_dir, other_tiny_model_dir):
    from cluster import TOO_LONG_FOR_TINY

    rows = _rows(tiny_model_dir, other_tiny_model_dir)
    rows.append({"custom_id": "long", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"model": other_tiny_model_dir.name, "max_tokens": 2,
                          "messages": [{"role": "user", "content": TOO_LONG_FOR_TINY}]}})
    src = write_jsonl(tmp_path / "mixed.jsonl", rows)
    result = runner.invoke(main, ["run", str(src), *_models(tiny_model_dir, other_tiny_model_dir), *FAST,
                                  "--database-url", sqlite_url])
    assert result.exit_code == 0, result.output   # completed, the long line an error row
    (old,) = [job for job in _jobs(sqlite_url)]
    assert old.models[1]["failed_requests"] == 1 and old.models[0]["failed_requests"] == 0
    retry = runner.invoke(main, ["retry", old.id, "--local", "--database-url", sqlite_url])
    new_id = retry.stdout.strip().splitlines()[0]
    new = next(job for job in _jobs(sqlite_url) if job.id == new_id)
    assert [m["engine_key"] for m in new.models] == [m["engine_key"] for m in old.models]
    engine = make_engine(sqlite_url)
    try:
        with session_factory(engine)() as s:
            shards = get_shards(s, new_id)
    finally:
        engine.dispose()
    assert [(sh.engine_key, sh.engine_fingerprint) for sh in shards] == [
        (old.models[1]["engine_key"], old.models[1]["engine_fingerprint"])]
    (row,) = pq.read_table(JobPaths(data_root, new_id).results_dir).to_pylist()
    assert row["id"] == "long" and row["engine"] == old.models[1]["engine_fingerprint"]


def test_served_names_let_a_hosted_file_name_each_model_as_it_did_and_a_retry_keeps_them(
        runner, sqlite_url, data_root, tmp_path, tiny_model_dir, other_tiny_model_dir):
    from cluster import TOO_LONG_FOR_TINY

    hosted = {"mini": "gpt-4o-mini", "big": "gpt-4o"}
    rows = [{"custom_id": f"{size}-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": model, "max_tokens": 2, "temperature": 0,
                      "messages": [{"role": "user", "content": TOO_LONG_FOR_TINY if i == 2 else f"Say {i}"}]}}
            for i in range(3) for size, model in hosted.items()]
    src = write_jsonl(tmp_path / "hosted.jsonl", rows)
    served = ["--served-model-name", f"gpt-4o-mini={tiny_model_dir.name}",
              "--served-model-name", f"gpt-4o={other_tiny_model_dir}"]
    result = runner.invoke(main, ["run", str(src), *_models(tiny_model_dir, other_tiny_model_dir), *FAST,
                                  *served, "--database-url", sqlite_url])
    assert result.exit_code == 0, result.output   # completed, each long line an error row
    (old,) = _jobs(sqlite_url)
    assert [m.get("served_names") for m in old.models] == [["gpt-4o-mini"], ["gpt-4o"]]
    assert [m["failed_requests"] for m in old.models] == [1, 1]
    results = pq.read_table(JobPaths(data_root, old.id).results_dir).to_pylist()
    assert sorted(r["id"] for r in results) == sorted(row["custom_id"] for row in rows)
    for r in results:   # each row computed by the model its served name names, and reporting that name
        model = 0 if r["id"].startswith("mini") else 1
        assert (r["model"], r["engine"]) == (list(hosted.values())[model], old.models[model]["engine_fingerprint"])

    retry = runner.invoke(main, ["retry", old.id, "--local", "--database-url", sqlite_url])
    new = next(job for job in _jobs(sqlite_url) if job.id == retry.stdout.strip().splitlines()[0])
    assert [m.get("served_names") for m in new.models] == [["gpt-4o-mini"], ["gpt-4o"]]
    retried = pq.read_table(JobPaths(data_root, new.id).results_dir).to_pylist()
    assert sorted((r["id"], r["engine"]) for r in retried) == [
        ("big-2", old.models[1]["engine_fingerprint"]), ("mini-2", old.models[0]["engine_fingerprint"])]

    # a model given served names has only those: its directory's name is another model's now
    by_dir = write_jsonl(tmp_path / "by-dir.jsonl", [{**rows[0], "body": {**rows[0]["body"],
                                                                            "model": tiny_model_dir.name}}])
    refused = runner.invoke(main, ["run", str(by_dir), *_models(tiny_model_dir, other_tiny_model_dir), *FAST,
                                   *served, "--database-url", sqlite_url])
    assert refused.exit_code == 2 and "line 1" in refused.output and "not one of the job's" in refused.output


def _jobs(db_url):
    engine = make_engine(db_url)
    try:
        with session_factory(engine)() as s:
            return list_jobs(s)
    finally:
        engine.dispose()


def test_a_stopping_worker_hands_a_shard_back_to_its_own_models_queue(sqlite_url, cluster_factory, tmp_path,
                                                                      tiny_model_dir, other_tiny_model_dir):
    """SIGTERM while a worker serving both models holds a shard of the second (tests/hold.py): the
    shard is released and handed back to the second model's queue, not the job's first model's; a
    worker of that model alone then finishes the job."""
    import signal

    import redis

    from workers.broker import priority_lists

    c = cluster_factory(sqlite_url)
    fast = ["--kv-cache-gib", "0.05", "--device", "cpu"]
    a_key, b_key = (engine_key({"model": str(d), "kv_cache_gib": 0.05, "device": "cpu"})
                    for d in (tiny_model_dir, other_tiny_model_dir))
    victim = c.start_worker(args=[*_models(tiny_model_dir, other_tiny_model_dir), *fast], held=True,
                            PIPELINE_WORKER_ENGINES="", PIPELINE_SHARDS_IN_FLIGHT=1)
    rows = ([{"id": f"quick-{i}", "prompt": f"Count {i}", "max_tokens": 2, "model": tiny_model_dir.name}
             for i in range(2)]
            + [{"id": f"held-{i:03d}", "prompt": f"Count {i}", "max_tokens": 64, "ignore_eos": True,
                "model": other_tiny_model_dir.name} for i in range(2)])
    src = write_jsonl(tmp_path / "mixed.jsonl", rows)
    done = c.cli("submit", str(src), *_models(tiny_model_dir, other_tiny_model_dir), *fast, "--shard-size", "2")
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip()
    c.wait_held(victim)
    assert [sh.status for sh in c.shards(job_id)] == ["completed", "running"]
    victim.send_signal(signal.SIGTERM)
    victim.wait(60)
    client = redis.Redis.from_url(c.broker_url)

    def messages(key):
        return [m for name in priority_lists(f"{c.queue}.{key}") for m in client.lrange(name, 0, -1)]

    handed = c.wait_for("the shard handed back to its model's queue", lambda: messages(b_key))
    assert json.loads(handed[0])["headers"]["argsrepr"] == f"(job_id={job_id!r}, shard=1)"
    assert messages(a_key) == []
    assert c.shards(job_id)[1].releases == 1
    c.release()
    successor = c.start_worker(args=["--model", str(other_tiny_model_dir), *fast], PIPELINE_WORKER_ENGINES="")
    assert c.wait_until_ended(job_id).status == "completed"
    c.assert_exactly_once(job_id, [r["id"] for r in rows])
    assert c.shards(job_id)[1].worker.rsplit(":", 1)[1] == str(successor.pid)


def test_a_rerun_reuses_each_models_own_answers(runner, sqlite_url, data_root, tmp_path, tiny_model_dir,
                                                 other_tiny_model_dir):
    """The answers' keys are each shard's model's: a rerun of the file reuses every answer, each from
    its own model's row (greedy lines on a batch-invariant CPU engine are deterministic)."""
    src = write_jsonl(tmp_path / "mixed.jsonl", _rows(tiny_model_dir, other_tiny_model_dir))
    args = ["run", str(src), *_models(tiny_model_dir, other_tiny_model_dir), *FAST, "--shard-size", "2",
            "--database-url", sqlite_url]
    assert runner.invoke(main, args).exit_code == 0
    assert runner.invoke(main, args).exit_code == 0
    first, second = sorted(_jobs(sqlite_url), key=lambda job: job.created_at)
    assert second.reused_requests == 7
    before = {r["id"]: r for r in pq.read_table(JobPaths(data_root, first.id).results_dir).to_pylist()}
    for r in pq.read_table(JobPaths(data_root, second.id).results_dir).to_pylist():
        assert r["reused_from"] == first.id and r["engine"] == before[r["id"]]["engine"]
        assert r["output"] == before[r["id"]]["output"]


def test_a_large_files_ranges_each_check_that_lines_name_their_model(tmp_path):
    """A large file is scanned in ranges by child processes (jobs.input.file_scan): the later range
    knows it is a job of several models too."""
    from jobs.input.file_scan import validate

    rows = []
    for i in range(4000):
        body = {"messages": [{"role": "user", "content": "hi"}]}
        if i != 3500:
            body["model"] = "a" if i % 2 else "b"
        rows.append({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
    names = SeveralEngines([("/x/a", {}), ("/y/b", {})]).names
    validation = validate(write_jsonl(tmp_path / "large.jsonl", rows), model=names, ranges=2)
    assert [e.line for e in validation.errors] == [3501]
    assert validation.errors[0].message.startswith("the line names no model")
