"""A model's files replaced under a running worker (a deploy renaming new weights over the
old): no answer of the old weights is ever stored under the new fingerprint or served for
it, and a job naming weights the worker cannot load fails with that reason.

A real `pipeline worker`, Redis and PostgreSQL, on a copy of the tiny model whose
model.safetensors is swapped for another random model's."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from cluster import Cluster
from jobs.paths import JobPaths
from jobs.results.parquet_files import read_results
from pipeline.models.fingerprint import model_fingerprint

WEIGHTS = "model.safetensors"


def greedy(i: int) -> dict:
    return {"id": f"q{i}", "prompt": f"Item {i}: describe it", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def outputs(root, job_id) -> dict[str, str]:
    return {r["id"]: r["output"] for r in read_results(JobPaths(root, job_id).results_dir).to_pylist()}


def deploy(weights_from, model_dir) -> None:
    """New weights as a deploy puts them: written beside, then renamed over the old file."""
    staged = model_dir / f".{WEIGHTS}.new"
    shutil.copy(weights_from / WEIGHTS, staged)
    os.replace(staged, model_dir / WEIGHTS)


@pytest.fixture
def model_dir(tmp_path, tiny_model_dir):
    copy = tmp_path / "served-model"
    shutil.copytree(tiny_model_dir, copy)
    return copy


@pytest.fixture
def make_cluster(tmp_path, data_root, postgres_url, model_dir):
    clusters = []

    def make(**env) -> Cluster:
        clusters.append(Cluster(tmp_path, data_root, postgres_url, model_dir, **env))
        return clusters[-1]

    yield make
    for c in clusters:
        c.stop()


def test_weights_replaced_under_a_running_worker_are_loaded_before_the_next_job_runs(
        make_cluster, model_dir, tiny_model_dir, other_tiny_model_dir):
    c = make_cluster()
    lines = [greedy(i) for i in range(4)]
    ids = [line["id"] for line in lines]
    c.start_worker()
    old = c.submit(lines, shard_size=2)
    assert c.wait_until_ended(old).status == "completed"

    deploy(other_tiny_model_dir, model_dir)   # the worker still holds the old weights
    new = c.submit(lines, shard_size=2)
    assert c.wait_until_ended(new).status == "completed"
    c.assert_exactly_once(new, ids)
    old_fp, new_fp = c.job(old).engine_fingerprint, c.job(new).engine_fingerprint
    assert old_fp != new_fp

    # The new job's answers are the new weights', computed afresh (nothing of the old job taken),
    # and keyed under the new fingerprint: the same as a --no-reuse run on those weights elsewhere.
    rows = read_results(JobPaths(c.root, new).results_dir).to_pylist()
    assert {(r["reused_from"], r["engine"]) for r in rows} == {(None, new_fp)}
    reference = c.cli("run", _write(c, lines), "--model",
                      str(other_tiny_model_dir), "--kv-cache-gib", "0.05", "--device", "cpu", "--no-reuse")
    assert reference.returncode == 0, reference.stderr
    ref_job = _job_id(reference.stdout + reference.stderr)
    assert outputs(c.root, new) == outputs(c.root, ref_job) != outputs(c.root, old)
    worker_log = c.log(c.procs[0])
    assert worker_log.count("loading engine ") == 2, worker_log   # loaded again, once, for the new weights

    # A rerun on the new weights takes the answers of those weights (the newest: the reference
    # run's, the same files elsewhere), never the old job's.
    again = c.submit(lines, shard_size=2)
    assert c.wait_until_ended(again).status == "completed"
    assert {r["reused_from"] for r in read_results(JobPaths(c.root, again).results_dir).to_pylist()} == {ref_job}
    assert outputs(c.root, again) == outputs(c.root, new)


def test_a_job_for_weights_the_worker_does_not_have_fails_saying_so(make_cluster, model_dir, other_tiny_model_dir):
    c = make_cluster(PIPELINE_MAX_ATTEMPTS=1)
    c.start_worker()
    job_id = c.create_job([greedy(0), greedy(1)], shard_size=2)   # fingerprinted on the weights there now
    deploy(other_tiny_model_dir, model_dir)                        # ... which change before any worker runs it
    c.enqueue(job_id, [0])
    job = c.wait_until_ended(job_id)
    assert (job.status, job.completed_requests, job.failed_requests) == ("completed", 0, 2), job.error
    rows = read_results(JobPaths(c.root, job_id).results_dir).to_pylist()
    assert {r["finish_reason"] for r in rows} == {"error"}
    assert all("EngineMismatch" in r["error"] and job.engine_fingerprint in r["error"] for r in rows), rows[0]["error"]
    # `pipeline retry` fingerprints the files afresh: the retry runs on the weights there now.
    retried = c.cli("retry", job_id)
    assert retried.returncode == 0, retried.stderr
    retry_id = retried.stdout.strip().split()[-1]
    retry = c.wait_until_ended(retry_id)
    assert (retry.status, retry.completed_requests) == ("completed", 2), retried.stdout + retried.stderr
    assert retry.engine_fingerprint != job.engine_fingerprint


def test_a_checkpoint_rewritten_in_place_with_its_time_restored_gets_a_new_fingerprint(model_dir,
                                                                                     other_tiny_model_dir):
    before = model_fingerprint(model_dir)
    weights = model_dir / WEIGHTS
    st = weights.stat()
    new = (other_tiny_model_dir / WEIGHTS).read_bytes()
    assert len(new) == st.st_size   # the same size: only the bytes (and ctime) tell
    with open(weights, "r+b") as f:   # in place: the same inode
        f.write(new)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = weights.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)
    assert model_fingerprint(model_dir) != before
    assert model_fingerprint(model_dir) == model_fingerprint(other_tiny_model_dir)


def _write(c: Cluster, lines) -> str:
    path = c.tmp_path / "reference.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def _job_id(text: str) -> str:
    import re
    return re.search(r"job_[0-9a-f]{16}", text)[0]
