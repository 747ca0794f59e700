"""Running one shard of a job: lease it, generate, write its results, commit, maybe finalize.

Shared by the Celery task and `pipeline run`; it knows nothing of Celery, and the engine
comes from `engine_provider(options, fingerprint)` (a context manager holding the process's
engine for the shard, refusing one whose model files are not the job's: workers.engine_cache),
so importing this module imports no torch either.
What a shard commits is counted in workers.metrics; its log records name the attempt
(workers.logs).
Several shards may run at once in one process (threads): each is leased, generated and
committed on its own, and their requests share the engine's batches.

Graceful shutdown: `request_shutdown()` (the worker calls it on SIGTERM) makes every
shard running in this process stop at its next engine step and hand its shard back with
ledger.release_shard (no attempt used up, nothing committed, outcome "released"); the
caller re-enqueues it. `pipeline run` never calls it: Ctrl-C there cancels the job.
"""
from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict
from enum import Enum

from sqlalchemy.orm import Session, sessionmaker

from jobs import ledger
from jobs.results import result_row
from jobs.results.finalize import finalize_job
from jobs.ledger import ShardStatus
from jobs.paths import JobPaths
from jobs.reuse.answer_key import request_key
from jobs.results.parquet_files import commit_rows
from jobs.reuse.stored_answers import answers_of, stored_answers
from jobs.scheduling import expired_error
from jobs.several_models import shard_job
from jobs.input.shard_files import read_shard_lines
from jobs.input.line_checks import RequestSpec
from workers import energy, logs, metrics
from workers.shard_requests import embedding_requests, prompt_requests, to_request

log = logging.getLogger(__name__)

CANCEL_POLL_S = 0.5
_shutdown = threading.Event()


class ShardOutcome(str, Enum):
    """What one run_shard call did (see run_shard); the last three are committed shard statuses."""
    SKIPPED = "skipped"
    BUSY = "busy"
    LOST = "lost"
    RELEASED = "released"
    COMPLETED = ShardStatus.COMPLETED.value
    CANCELLED = ShardStatus.CANCELLED.value
    FAILED = ShardStatus.FAILED.value

    __str__ = str.__str__  # the plain word, as the task's return value and in logs


def request_shutdown() -> None:
    """Make the shards running in this process (and any started later) release their shard."""
    _shutdown.set()


def shutting_down() -> bool:
    return _shutdown.is_set()


@metrics.runs_shards
@energy.accounts_shards
def run_shard(
    Session: sessionmaker[Session], root, job_id: str, index: int, *,
    engine_provider: Callable[[dict, str | None], AbstractContextManager], worker_name: str, lease_s: float = 60,
    max_attempts: int = 3, on_result: Callable[[dict], None] | None = None,
) -> ShardOutcome:
    """Run shard `index` of `job_id`; returns its outcome.

    "skipped": nothing to do (shard done or cancelled, job not live); "busy": running
    under another attempt (a live lease, or a dead one with no attempts left, which is
    a reaper's job); "lost": our lease was taken over
    mid-run, nothing committed; "released": this process is shutting down
    (request_shutdown), the shard is queued again with its attempt given back, nothing
    committed, and the caller must re-enqueue it; "completed" / "cancelled" / "failed":
    committed so.
    An exception (model load, engine crash) propagates with the shard still leased, so
    it is retried once the lease expires; on the last allowed attempt the shard is
    committed as "failed" with an error row per request instead, so the job can end.
    on_result(row) is called for each result row as it is made (progress bars).
    """
    if _shutdown.is_set():
        return ShardOutcome.RELEASED  # never claimed: the caller re-enqueues it as for a released one
    with Session() as s:
        expired = ledger.expire_if_due(s, job_id)   # past its completion window: no shard of it starts
    if expired:
        finalize_job(Session, root, job_id)
        return ShardOutcome.SKIPPED
    with Session() as s:
        attempt = ledger.claim_shard(s, job_id, index, worker_name, lease_s, max_attempts)
        shard = ledger.get_shard(s, job_id, index)
        if attempt is None or shard is None:  # (None: a message for a job that no longer exists)
            busy = shard is not None and shard.status == ShardStatus.RUNNING
            return ShardOutcome.BUSY if busy else ShardOutcome.SKIPPED
        job = shard_job(ledger.get_job(s, job_id), shard)   # a several-model job's shard: its own engine
    logs.bind_attempt(attempt)
    paths = JobPaths(root, job_id)
    last_attempt = attempt - shard.releases >= max_attempts
    try:
        lines = read_input_lines(paths, index)
    except InputUnreadable as e:
        return _fail_unreadable(Session, root, job_id, index, attempt, e, last_attempt)
    specs = [RequestSpec.from_dict(line) for line in lines]
    # Every row carries its key (lineage), made of its line as the submit's lookup makes it
    # (jobs.reuse.stored_answers); a first submit made none.
    for spec, line in zip(specs, lines):
        spec.key = request_key(line, job.engine_fingerprint, job.answer_scope)
    lease = _LeaseKeeper(Session, job_id, index, attempt, lease_s)
    try:
        reused = _reused_rows(Session, root, job, specs, index, attempt, on_result)
        to_run = [spec for spec in specs if spec.id not in reused]
        try:
            rows, cancelled, interrupted = [], False, False
            if to_run:   # a shard answered whole from stored answers needs no engine
                with engine_provider(job.engine_options, job.engine_fingerprint) as engine:
                    rows, cancelled, interrupted = _generate(Session, job, engine, to_run, index, attempt,
                                                             lease, on_result, worker_name)
            status = ShardStatus.CANCELLED if cancelled else ShardStatus.COMPLETED
        except Exception as e:
            if not last_attempt:
                _note_error(Session, job_id, index, attempt, f"{type(e).__name__}: {e}")
                raise
            log.exception("shard %s/%d failed on its last attempt", job_id, index)
            error = f"the shard failed {max_attempts} times; last error: {type(e).__name__}: {e}"
            rows, status = result_row.error_rows(to_run, error, index, attempt), ShardStatus.FAILED
        rows = _in_input_order(specs, reused, rows)
        if lease.lost.is_set():
            return ShardOutcome.LOST
        if status == ShardStatus.COMPLETED and interrupted and _shutdown.is_set():
            lease.stop()  # no renewal may race the release
            with Session() as s:
                released = ledger.release_shard(s, job_id, index, attempt)
            paths.tmp_result(index, attempt).unlink(missing_ok=True)
            return ShardOutcome.RELEASED if released else ShardOutcome.LOST
        usage = energy.charge_shard(job_id, index)   # its joules, device-seconds, cost: written by the commit
        totals = result_row.shard_totals(rows)   # once, for the ledger and the metrics
        try:
            committed = commit_rows(Session, paths, job_id, index, attempt, rows, status,
                                    answers=answers_of(specs, rows), usage=asdict(usage) if usage else None,
                                    totals=totals)
        except Exception as e:   # its cause goes on the shard, so the reaper gives it, not "stopped responding"
            cause = str(e).splitlines()[0][:500] if str(e) else ""   # a database error's first line, not its SQL
            _note_error(Session, job_id, index, attempt, f"committing the shard failed: {type(e).__name__}: {cause}")
            raise
        if not committed:
            return ShardOutcome.LOST
        metrics.count_results(rows, job.model, totals)
        metrics.count_usage(usage, job.model)
    finally:
        lease.stop()
    finalize_job(Session, root, job_id)
    return ShardOutcome(status)


class InputUnreadable(OSError):
    """This process cannot read a shard's input file (the message says where it looked)."""


def read_input(paths: JobPaths, index: int) -> list[RequestSpec]:
    """The requests of input shard `index` (read_input_lines)."""
    return [RequestSpec.from_dict(line) for line in read_input_lines(paths, index)]


def read_input_lines(paths: JobPaths, index: int) -> list[dict]:
    """The lines of input shard `index`; InputUnreadable names the file and the data
    directory when they are not there (an unmounted share, another PIPELINE_DATA_DIR)."""
    path = paths.input_shard(index)
    try:
        return read_shard_lines(path)
    except (OSError, ValueError) as e:
        where = (f"the job's directory {paths.dir} does not exist: is {paths.root} the data directory "
                 f"the job was submitted with (PIPELINE_DATA_DIR, a shared filesystem every worker mounts)?"
                 if not paths.dir.is_dir() else f"{type(e).__name__}: {e}")
        raise InputUnreadable(f"cannot read the shard's input {path}: {where}") from e


def commit_error_rows(Session, root, job_id: str, index: int, attempt: int, error: str, *, tmp_path) -> bool:
    """Commit shard `index` as failed with one error row per request of its input file,
    under `attempt` (the reaper, for a shard whose attempts are used up). tmp_path must
    not be a name any worker attempt uses. False if that attempt no longer holds it;
    InputUnreadable if the input cannot be read (no rows can be written)."""
    paths = JobPaths(root, job_id)
    rows = result_row.error_rows(read_input(paths, index), error, index, attempt)
    return commit_rows(Session, paths, job_id, index, attempt, rows, ShardStatus.FAILED, tmp_path=tmp_path)


def _fail_unreadable(Session, root, job_id, index, attempt, e: InputUnreadable, last_attempt: bool) -> ShardOutcome:
    """A shard whose input this process cannot read: the error goes on the shard; the
    attempt is retried (raise) while attempts are left, else the shard fails without rows
    and the job's finalizer writes its error rows, or fails the job, naming the cause."""
    log.error("shard %s/%d: %s", job_id, index, e)
    if not last_attempt:
        _note_error(Session, job_id, index, attempt, str(e))
        raise e
    with Session() as s:
        failed = ledger.fail_shard(s, job_id, index, attempt, str(e))
    if not failed:
        return ShardOutcome.LOST
    finalize_job(Session, root, job_id)
    return ShardOutcome.FAILED


def _note_error(Session, job_id: str, index: int, attempt: int, error: str) -> None:
    """Keep an attempt's error on its shard (the reaper's message quotes it); best effort."""
    try:
        with Session() as s:
            ledger.note_shard_error(s, job_id, index, attempt, error)
    except Exception:
        log.warning("recording the error of %s/%d failed", job_id, index, exc_info=True)


def _reused_rows(Session, root, job, specs, index, attempt, on_result) -> dict[str, list[dict]]:
    """The rows of the requests answered from stored answers (jobs.reuse.stored_answers), by id; none when
    the job was submitted with --no-reuse."""
    if not job.reuse:
        return {}
    rows = {}
    answers = stored_answers(Session, root, job.id, specs)
    for spec in specs:
        if spec.id in answers:
            source, stored = answers[spec.id]
            rows[spec.id] = [result_row.reused(row, spec, index, attempt, source) for row in stored]
            for row in rows[spec.id]:
                _notify(on_result, row)
    return rows


def _in_input_order(specs, reused: dict[str, list[dict]], computed: list[dict]) -> list[dict]:
    """Every row of the shard in input order: a request's reused rows or its computed ones."""
    by_id: dict[str, list[dict]] = {}
    for row in computed:
        by_id.setdefault(row["id"], []).append(row)
    return [row for spec in specs for row in (reused.get(spec.id) or by_id.get(spec.id, ()))]


def _generate(Session, job, engine, specs, index, attempt, lease, on_result, worker_name=None):
    """Result rows in input order (a request's choices in order), whether generation stopped because of a cancel or the
    job's expiry, and whether it stopped early for another reason (a lost lease,
    request_shutdown). The requests an expiry left unfinished get error rows
    (jobs.scheduling.expired_error), those a cancel left get cancelled rows."""
    job_id = job.id
    answers: dict[str, tuple[RequestSpec, int]] = {}   # engine request id -> (spec, choice it answers)
    rows: dict[tuple[str, int], dict] = {}   # (id, choice) -> row: one per answer
    requests = []
    for spec in specs:
        try:
            if spec.is_embedding:   # one engine request per input, each answering one choice
                for choice, request in enumerate(embedding_requests(spec, job.request_timeout_s)):
                    requests.append(request)
                    answers[request.id] = spec, choice
            elif spec.prompts is not None:   # one per prompt, each answering n choices from i * n
                for i, request in enumerate(prompt_requests(spec, job.request_timeout_s)):
                    requests.append(request)
                    answers[request.id] = spec, i * spec.n
            else:
                requests.append(to_request(spec, job.request_timeout_s))
                answers[spec.id] = spec, 0
        except ValueError as e:  # e.g. a sampling setting the engine rejects: this request fails alone
            for row in result_row.error_rows([spec], f"invalid request: {e}", index, attempt):
                rows[spec.id, row["choice"]] = row
                _notify(on_result, row)
    start = time.perf_counter()
    with _CancelPoll(Session, job_id) as cancel:
        stop = lambda: lease.lost.is_set() or _shutdown.is_set() or cancel()  # noqa: E731
        for out in engine.generate(requests, should_stop=stop):
            spec, choice = answers[out.id]
            out.id, out.choice = spec.id, choice + out.choice
            row = result_row.from_output(out, index, attempt, spec, worker=worker_name, engine=job.engine_fingerprint)
            rows[out.id, out.choice] = row
            _notify(on_result, row)
    # Whatever did not finish was dropped by should_stop: a cancel, or a lost lease or a
    # shutdown (both never committed).
    keys = [(spec, choice) for spec in specs for choice in range(spec.num_rows)]
    interrupted = len(rows) < len(keys)
    waited = time.perf_counter() - start
    for spec, choice in keys:
        if (spec.id, choice) not in rows:
            if cancel.reason == "expired":
                row = result_row.error_row(spec, expired_error(job.completion_window), index, attempt, choice)
            else:   # it waited from the shard's start until the cancel, and got nothing
                row = result_row.cancelled_row(spec, waited, index, attempt, choice)
            rows[spec.id, choice] = row
            _notify(on_result, row)
    return [rows[spec.id, choice] for spec, choice in keys], cancel.seen, interrupted


def _notify(on_result, row: dict) -> None:
    if on_result is not None:
        on_result(row)


class _CancelPoll:
    """should_stop for a cancel or the job's expiry (ledger.stop_reason, which expires a job
    past its expires_at; `reason` says which stopped it). The answer per job is shared by every shard of it running
    in this process (a worker often runs several of one job), so the ledger is asked at
    most once every CANCEL_POLL_S seconds per job, not once per shard: each query is
    Python work that holds the GIL the engine thread needs."""

    _lock = threading.Lock()
    _jobs: dict[tuple, list] = {}   # (Session, job_id) -> [next poll time, reason, shards polling]

    def __init__(self, Session, job_id: str):
        self.Session, self.job_id = Session, job_id
        self._key = (Session, job_id)
        with self._lock:
            self._jobs.setdefault(self._key, [0.0, None, 0])[2] += 1
        self.reason: str | None = None

    @property
    def seen(self) -> bool:
        """Whether a cancel or an expiry stopped the shard."""
        return self.reason is not None

    def __call__(self) -> bool:
        if self.seen:
            return True
        now = time.monotonic()
        with self._lock:
            state = self._jobs[self._key]
            due = now >= state[0]
            if due:
                state[0] = now + CANCEL_POLL_S   # the other shards wait for this answer
            self.reason = state[1]
        if due and not self.seen:
            with self.Session() as s:
                reason = ledger.stop_reason(s, self.job_id)
            with self._lock:
                state[1] = state[1] or reason
                self.reason = state[1]
        return self.seen

    def __enter__(self) -> "_CancelPoll":
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            state = self._jobs[self._key]
            state[2] -= 1
            if state[2] == 0:
                del self._jobs[self._key]


class _LeaseKeeper:
    """A daemon thread renewing the shard's lease every lease_s / 3; `lost` is set once the
    ledger says another attempt owns the shard."""

    def __init__(self, Session, job_id: str, index: int, attempt: int, lease_s: float):
        self.lost = threading.Event()
        self._stop = threading.Event()
        context = contextvars.copy_context()   # its log records are about the shard too
        self._thread = threading.Thread(
            target=context.run, args=(self._run, Session, job_id, index, attempt, lease_s),
            name=f"lease-{job_id}-{index}", daemon=True)
        self._thread.start()

    def _run(self, Session, job_id, index, attempt, lease_s) -> None:
        while not self._stop.wait(lease_s / 3):
            try:
                with Session() as s:
                    if not ledger.renew_lease(s, job_id, index, attempt, lease_s):
                        self.lost.set()
                        return
            except Exception:  # a database hiccup: the lease may still be ours, try again
                log.warning("renewing the lease of %s/%d failed", job_id, index, exc_info=True)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
