"""`pipeline run` stopped by a signal (what finished is kept, the job is cancelled, `pipeline
retry --local` runs the rest) or killed (`pipeline resume` finishes the job in place, leaving a
live worker's shard to it). The run is held mid-generation (tests/hold.py) when the signal or
the kill comes, on any machine."""
from __future__ import annotations

import signal
import subprocess
from datetime import timedelta

import pytest

from jobs.ledger import list_jobs
from jobs.paths import JobPaths, check_job_id
from jobs.results.parquet_files import read_results
from cluster import WAIT_S, Cluster, quick_then_held, write_jsonl


def start_held_run(c: Cluster, rows: list[dict]) -> tuple[subprocess.Popen, str]:
    """A `pipeline run` subprocess of rows in shards of 4, one shard in flight (so that the
    shards after the running one are still queued), under tests/hold.py's hold; its job id,
    once the run holds its first "held-" request mid-generation."""
    src = write_jsonl(c.tmp_path / "run.jsonl", rows)
    proc = c.start_cli("run", str(src), "--model", str(c.model_dir), "--kv-cache-gib", "0.05", "--shard-size", "4",
                       held=True, PIPELINE_SHARDS_IN_FLIGHT=1)
    c.wait_held(proc)
    with c.Session() as s:
        return proc, list_jobs(s)[0].id


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_pipeline_run_stopped_by_a_signal_keeps_what_finished_then_retry_runs_the_rest(sig, code, sqlite_url,
                                                                                      cluster_factory):
    """The run is held with shard 0 committed and shard 1 four tokens in (on an AMX Xeon
    the 16 requests of 2,000 tokens it raced before had all finished when the signal came);
    the signal's cancel is what ends the hold: its shard stops at its next step."""
    c = cluster_factory(sqlite_url)
    rows = quick_then_held(4, 12)
    run, job_id = start_held_run(c, rows)
    assert [sh.status for sh in c.shards(job_id)] == ["completed", "running", "queued", "queued"]
    run.send_signal(sig)
    assert run.wait(timeout=WAIT_S) == code, c.log(run)
    log = c.log(run)
    assert f"job {job_id} cancelled with" in log and f"`pipeline retry {job_id} --local` runs the rest" in log
    assert "Traceback" not in log
    assert c.job(job_id).status == "cancelled"
    # what finished is kept: the warm shard, and the interrupted shard's rows (cancelled, not failed)
    assert [sh.status for sh in c.shards(job_id)] == ["completed", "cancelled", "cancelled", "cancelled"]
    table = read_results(JobPaths(c.root, job_id).results_dir)
    assert sorted(set(table["shard"].to_pylist())) == [0, 1] and table.num_rows == 8
    reasons = dict(zip(table["id"].to_pylist(), table["finish_reason"].to_pylist()))
    assert {reasons[r["id"]] for r in rows[4:8]} == {"cancelled"}   # held four tokens in: none could finish
    done = c.cli("resume", job_id)  # a cancelled job is not resumed: retried
    assert done.returncode == 1 and f"pipeline retry {job_id} --local" in done.stderr, done.stderr
    done = c.cli("retry", job_id, "--local")
    assert done.returncode == 0, done.stderr
    retry_id = check_job_id(done.stdout.splitlines()[0])
    c.assert_answered_once([job_id, retry_id], [r["id"] for r in rows])


def test_pipeline_run_killed_is_resumed_in_place_leaving_a_live_workers_shard_to_it(sqlite_url, cluster_factory):
    from sqlalchemy import update

    from jobs.ledger import Shard, claim_shard, utcnow

    c = cluster_factory(sqlite_url)
    rows = quick_then_held(4, 12)
    run, job_id = start_held_run(c, rows)
    run.kill()  # SIGKILL: no handler runs, the job stays in_progress with shard 1 leased
    run.wait(timeout=30)
    assert c.job(job_id).status == "in_progress"
    assert [sh.status for sh in c.shards(job_id)] == ["completed", "running", "queued", "queued"]
    done = c.cli("status", job_id)
    assert done.returncode == 0 and f"pipeline resume {job_id}" in done.stdout, done.stdout
    with c.Session() as s:  # a live worker takes shard 2 (its lease outlives the test's waits)
        assert claim_shard(s, job_id, 2, "live-worker:1", 10 * WAIT_S, 3) == 1

    resume = c.start_cli("resume", job_id)
    c.wait_for("shards 1 and 3 finished by resume",
               lambda: (resume.poll() is None or pytest.fail(f"resume ended early:\n{c.log(resume)}"))
               and [sh.status for sh in c.shards(job_id)] == ["completed", "completed", "running", "completed"])
    # resume's note, once only shard 2 is left: it saw the live lease and leaves the shard to it
    c.wait_for("resume leaving shard 2 to its holder", lambda: "shard 2 is held by live-worker:1" in c.log(resume))
    held = c.shards(job_id)[2]
    assert (held.status, held.attempt, held.worker) == ("running", 1, "live-worker:1") and resume.poll() is None
    with c.Session() as s:  # the live worker dies: pretend its lease ran out a minute ago
        s.execute(update(Shard).where(Shard.job_id == job_id, Shard.index == 2)
                  .values(lease_expires_at=utcnow() - timedelta(seconds=60)))
        s.commit()
    assert resume.wait(timeout=WAIT_S) == 0, c.log(resume)
    job = c.job(job_id)
    assert (job.status, job.completed_requests, job.failed_requests) == ("completed", len(rows), 0)
    c.assert_exactly_once(job_id, [r["id"] for r in rows])
    shards = c.shards(job_id)
    assert (shards[0].attempt, shards[0].worker.rsplit(":", 1)[1]) == (1, str(run.pid))   # kept as committed
    assert [sh.attempt for sh in shards[1:]] == [2, 2, 1]    # after the killed attempt, the live worker's, none
    assert all(sh.worker.endswith(f":{resume.pid}") for sh in shards[1:])
