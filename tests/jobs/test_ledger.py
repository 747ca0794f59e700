"""The job ledger on real SQLite and PostgreSQL: leases, fencing, finalization, cancel. The
schema, its migrations and the API keys: test_ledger_schema.py."""
from __future__ import annotations

import threading
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import update

from jobs.ledger import (
    JobStatus, Shard, ShardStatus, claim_shard, commit_shard, create_job, expired_shards, fail_shard, finish_job,
    get_job, get_shard, get_shards, is_cancelling, job_as_dict, job_counts, list_jobs, queued_shards, release_shard,
    renew_lease, request_cancel, retries_of, try_finalize,
)
from jobs.paths import JobPaths, new_job_id
from jobs.results.parquet_files import read_results, write_shard_tmp
from ledger_helpers import make_job

LEASE = 60.0


def expire_lease(Session, job_id, index):
    """Pretend the lease holder went silent a minute ago."""
    with Session() as s:
        s.execute(update(Shard).where(Shard.job_id == job_id, Shard.index == index)
                  .values(lease_expires_at=datetime.now(timezone.utc) - timedelta(minutes=1)))
        s.commit()


def in_threads(n, fn):
    """Run fn(i) in n threads released together; return their results in order."""
    barrier = threading.Barrier(n)
    results = [None] * n
    errors = []

    def run(i):
        try:
            barrier.wait()
            results[i] = fn(i)
        except BaseException as exc:  # surfaced below, threads swallow exceptions
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


def rows(shard, attempt, n):
    return [{"id": f"r{shard}-{i}", "output": f"attempt {attempt}", "prompt_tokens": 5,
             "output_tokens": 7, "finish_reason": "stop", "latency_s": 0.5, "shard": shard,
             "attempt": attempt} for i in range(n)]


def test_create_job_queues_one_shard_per_size(ledger):
    _, Session = ledger
    job_id = make_job(Session, sizes=(3, 3, 1))
    with Session() as s:
        job = get_job(s, job_id)
        assert (job.status, job.num_shards, job.total_requests) == (JobStatus.QUEUED, 3, 7)
        assert job.metadata_ == {"owner": "tests"} and job.engine_options == {"max_batch": 8}
        assert job.created_at.tzinfo is not None and job.started_at is None
        shards = get_shards(s, job_id)
        assert [(x.index, x.status, x.attempt, x.num_requests) for x in shards] == [
            (0, "queued", 0, 3), (1, "queued", 0, 3), (2, "queued", 0, 1)]
        assert job_as_dict(job)["metadata"] == {"owner": "tests"}
        assert get_job(s, "job_0000000000000000") is None


def test_list_jobs_newest_first(ledger):
    _, Session = ledger
    ids = [make_job(Session) for _ in range(3)]
    with Session() as s:
        assert [j.id for j in list_jobs(s)] == ids[::-1]
        assert len(list_jobs(s, limit=2)) == 2


def test_retries_of_finds_the_jobs_made_from_a_job(ledger):
    _, Session = ledger
    old, other = make_job(Session), make_job(Session)
    retries = []
    for of in (old, other, old):
        retries.append(new_job_id())
        with Session() as s:
            create_job(s, job_id=retries[-1], model="m", engine_options={}, input_format="pipeline", endpoint=None,
                       input_path="/in", results_path="/out", shard_size=1, shard_sizes=[1],
                       metadata={"owner": "tests", "retry_of": of})
    with Session() as s:
        assert [j.id for j in retries_of(s, old)] == [retries[0], retries[2]]
        assert [j.id for j in retries_of(s, other)] == [retries[1]] and retries_of(s, retries[0]) == []


def test_get_shard_reads_one_shard_afresh_by_its_index(ledger):
    _, Session = ledger
    job_id = make_job(Session, sizes=(3, 3, 1))
    with Session() as reader:
        assert (get_shard(reader, job_id, 2).index, get_shard(reader, job_id, 2).num_requests) == (2, 1)
        assert get_shard(reader, job_id, 3) is None and get_shard(reader, "job_0000000000000000", 0) is None
        with Session() as writer:   # another process claims it: the reader's session sees the new state
            assert claim_shard(writer, job_id, 1, "w1", LEASE, max_attempts=3) == 1
        shard = get_shard(reader, job_id, 1)
        assert (shard.status, shard.worker, shard.attempt) == ("running", "w1", 1)


def test_claim_is_exclusive_while_the_lease_lives(ledger):
    _, Session = ledger
    job_id = make_job(Session)
    with Session() as s:
        before = datetime.now(timezone.utc)
        assert claim_shard(s, job_id, 0, "w1", LEASE, max_attempts=3) == 1
        after = datetime.now(timezone.utc)
        assert claim_shard(s, job_id, 0, "w2", LEASE, max_attempts=3) is None
        job = get_job(s, job_id)
        assert job.status == JobStatus.IN_PROGRESS and job.started_at is not None
        shard = get_shards(s, job_id)[0]
        assert (shard.status, shard.worker, shard.attempt) == ("running", "w1", 1)
        # LEASE from the claim (the clock read around it, however long the test takes after)
        assert before + timedelta(seconds=LEASE) <= shard.lease_expires_at <= after + timedelta(seconds=LEASE)
        assert renew_lease(s, job_id, 0, 1, LEASE)


def test_expired_lease_fences_the_stale_attempt(ledger, data_root):
    _, Session = ledger
    job_id = make_job(Session)
    jp = JobPaths(data_root, job_id)
    with Session() as s:
        assert claim_shard(s, job_id, 0, "slow", LEASE, max_attempts=3) == 1
        write_shard_tmp(rows(0, 1, 3), jp.tmp_result(0, 1))
        expire_lease(Session, job_id, 0)
        assert claim_shard(s, job_id, 0, "fast", LEASE, max_attempts=3) == 2

        assert not renew_lease(s, job_id, 0, 1, LEASE)
        assert not commit_shard(s, job_id, 0, 1, totals=dict(completed_requests=3, failed_requests=0, prompt_tokens=15, output_tokens=21), tmp_path=jp.tmp_result(0, 1),
                                final_path=jp.result_shard(0))
        assert not jp.tmp_result(0, 1).exists() and not jp.result_shard(0).exists()

        write_shard_tmp(rows(0, 2, 3), jp.tmp_result(0, 2))
        assert commit_shard(s, job_id, 0, 2, totals=dict(completed_requests=3, failed_requests=0, prompt_tokens=15, output_tokens=21, cached_tokens=8), tmp_path=jp.tmp_result(0, 2),
                            final_path=jp.result_shard(0))
        assert not jp.tmp_result(0, 2).exists()
        assert set(read_results(jp.results_dir)["attempt"].to_pylist()) == {2}
        shard = get_shards(s, job_id)[0]
        assert (shard.status, shard.attempt, shard.completed_requests) == ("completed", 2, 3)
        # A committed shard is final: neither attempt can touch it again.
        assert not renew_lease(s, job_id, 0, 2, LEASE)
        assert claim_shard(s, job_id, 0, "late", LEASE, max_attempts=3) is None
        job = get_job(s, job_id)
        assert (job.completed_requests, job.prompt_tokens, job.output_tokens, job.cached_tokens) == (3, 15, 21, 8)
        assert job_counts(s, job_id) == {
            "total_requests": 5, "completed_requests": 3, "failed_requests": 0,
            "prompt_tokens": 15, "output_tokens": 21, "cached_tokens": 8, "draft_tokens": 0, "accepted_tokens": 0,
            "shards": {"completed": 1, "queued": 1}}


def test_concurrent_claims_have_exactly_one_winner(ledger):
    _, Session = ledger
    job_id = make_job(Session)

    def claim(i):
        with Session() as s:
            return claim_shard(s, job_id, 0, f"w{i}", LEASE, max_attempts=3)

    results = in_threads(8, claim)
    assert sorted(results, key=lambda r: r is not None) == [None] * 7 + [1]


def test_release_requeues_without_using_an_attempt(ledger, data_root):
    _, Session = ledger
    job_id = make_job(Session)
    jp = JobPaths(data_root, job_id)
    with Session() as s:
        assert claim_shard(s, job_id, 0, "w1", LEASE, max_attempts=1) == 1
        assert release_shard(s, job_id, 0, 1)
        assert not release_shard(s, job_id, 0, 1)
        assert get_shards(s, job_id)[0].status == ShardStatus.QUEUED
        # max_attempts=1 still allows it: the release did not count. The token still grows.
        assert claim_shard(s, job_id, 0, "w2", LEASE, max_attempts=1) == 2
        write_shard_tmp(rows(0, 1, 1), jp.tmp_result(0, 1))
        assert not commit_shard(s, job_id, 0, 1, totals=dict(completed_requests=1, failed_requests=0, prompt_tokens=1, output_tokens=1), tmp_path=jp.tmp_result(0, 1),
                                final_path=jp.result_shard(0))


def test_exhausted_attempts_are_reported_not_requeued(ledger):
    _, Session = ledger
    job_id = make_job(Session, sizes=(2,))
    with Session() as s:
        assert claim_shard(s, job_id, 0, "w", LEASE, max_attempts=2) == 1
        expire_lease(Session, job_id, 0)
        assert expired_shards(s, max_attempts=2) == ([(job_id, 0)], [])
        assert get_shards(s, job_id)[0].status == ShardStatus.QUEUED
        assert expired_shards(s, max_attempts=2) == ([], [])

        assert claim_shard(s, job_id, 0, "w", LEASE, max_attempts=2) == 2
        expire_lease(Session, job_id, 0)
        assert expired_shards(s, max_attempts=2) == ([], [(job_id, 0)])
        assert claim_shard(s, job_id, 0, "w", LEASE, max_attempts=2) is None

        assert fail_shard(s, job_id, 0, None, "lease expired 2 times")
        assert not fail_shard(s, job_id, 0, None, "again")
        shard = get_shards(s, job_id)[0]
        assert (shard.status, shard.error) == ("failed", "lease expired 2 times")
        assert try_finalize(s, job_id)
        assert finish_job(s, job_id, JobStatus.COMPLETED, None)


def test_fail_shard_with_attempt_is_fenced(ledger):
    _, Session = ledger
    job_id = make_job(Session)
    with Session() as s:
        assert claim_shard(s, job_id, 1, "w", LEASE, max_attempts=3) == 1
        assert not fail_shard(s, job_id, 1, 2, "wrong attempt")
        assert fail_shard(s, job_id, 1, 1, "boom")


def test_try_finalize_has_exactly_one_winner(ledger, data_root):
    _, Session = ledger
    job_id = make_job(Session, sizes=(1, 1))
    jp = JobPaths(data_root, job_id)
    with Session() as s:
        assert not try_finalize(s, job_id)  # shards still queued
        for i in (0, 1):
            attempt = claim_shard(s, job_id, i, "w", LEASE, max_attempts=3)
            assert not try_finalize(s, job_id)  # a shard is running
            write_shard_tmp(rows(i, attempt, 1), jp.tmp_result(i, attempt))
            assert commit_shard(s, job_id, i, attempt, totals=dict(completed_requests=1, failed_requests=0, prompt_tokens=5, output_tokens=7), tmp_path=jp.tmp_result(i, attempt),
                                final_path=jp.result_shard(i))

    def finalize(_):
        with Session() as s:
            return try_finalize(s, job_id)

    assert sorted(in_threads(8, finalize)) == [False] * 7 + [True]
    with Session() as s:
        job = get_job(s, job_id)
        assert job.status == JobStatus.FINALIZING and job.finalizing_at is not None
        stats = {"total_requests": 99, "completed_requests": 2, "failed_requests": 0,
                 "prompt_tokens": 10, "output_tokens": 14, "wall_seconds": 2.0,
                 "output_tok_s": 7.0, "total_tok_s": 12.0, "latency_p50": 0.5,
                 "latency_p95": 0.5, "latency_p99": 0.5, "ttft_p50": None, "ttft_p95": None}
        assert not finish_job(s, job_id, JobStatus.CANCELLED, stats)  # not cancelling
        assert finish_job(s, job_id, JobStatus.COMPLETED, stats)
        assert not finish_job(s, job_id, JobStatus.COMPLETED, stats)
        job = get_job(s, job_id)
        assert job.status == JobStatus.COMPLETED and job.finished_at >= job.finalizing_at
        assert (job.total_requests, job.completed_requests, job.output_tok_s) == (2, 2, 7.0)
        with pytest.raises(ValueError):
            finish_job(s, job_id, JobStatus.COMPLETED, {"bogus": 1})


def test_request_cancel(ledger, data_root):
    _, Session = ledger
    job_id = make_job(Session, sizes=(2, 2, 2))
    jp = JobPaths(data_root, job_id)
    with Session() as s:
        attempt = claim_shard(s, job_id, 0, "w", LEASE, max_attempts=3)
        assert not is_cancelling(s, job_id)
        assert request_cancel(s, job_id)
        assert not request_cancel(s, job_id)
        assert is_cancelling(s, job_id)
        job = get_job(s, job_id)
        assert job.status == JobStatus.CANCELLING and job.cancelling_at is not None
        assert [x.status for x in get_shards(s, job_id)] == ["running", "cancelled", "cancelled"]
        assert claim_shard(s, job_id, 1, "w", LEASE, max_attempts=3) is None
        assert not try_finalize(s, job_id)  # shard 0 still running

        # The running shard notices and commits what it has as a cancelled shard.
        write_shard_tmp(rows(0, attempt, 1), jp.tmp_result(0, attempt))
        assert commit_shard(s, job_id, 0, attempt, totals=dict(completed_requests=1, failed_requests=0, prompt_tokens=5, output_tokens=7), tmp_path=jp.tmp_result(0, attempt),
                            final_path=jp.result_shard(0), status=ShardStatus.CANCELLED)
        assert try_finalize(s, job_id)
        assert not try_finalize(s, job_id)
        assert get_job(s, job_id).status == JobStatus.CANCELLING
        assert not finish_job(s, job_id, JobStatus.COMPLETED, None)
        assert finish_job(s, job_id, JobStatus.CANCELLED, None)
        assert get_job(s, job_id).status == JobStatus.CANCELLED
        assert not request_cancel(s, job_id)


def test_queued_shards_reports_long_waiting_shards(ledger):
    _, Session = ledger
    job_id = make_job(Session, sizes=(1, 1))
    with Session() as s:
        assert queued_shards(s, older_than_s=3600) == []
        assert queued_shards(s, older_than_s=-1) == [(job_id, 0), (job_id, 1)]
        claim_shard(s, job_id, 0, "w", LEASE, max_attempts=3)
        assert queued_shards(s, older_than_s=-1) == [(job_id, 1)]
        request_cancel(s, job_id)
        assert queued_shards(s, older_than_s=-1) == []
