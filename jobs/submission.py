"""Turning an input file into a queued job: validate, write the input shards, record the job.

All or nothing: an invalid file raises jobs.input.line_checks.InvalidInput before anything exists, and
any later failure removes the job's directory again, so no half-created job is left.
Standard input (`create_job_from_stream`) is read once, into the job's own copy.
`create_retry_job` makes a new job of the unanswered requests of an ended one.
"""
from __future__ import annotations

import contextlib
import dataclasses
import shutil
from pathlib import Path
from typing import BinaryIO

from sqlalchemy.orm import Session, sessionmaker

from jobs import ledger
from jobs.input.validation import InvalidInput, LineError, Limits, Validation
from jobs.atomic_files import atomic_write
from jobs.paths import JobPaths, check_job_id, new_job_id
from jobs.input.field_checks import EMBEDDINGS_ENDPOINT
from jobs.input.file_scan import write_input_shards
from jobs.reuse.answer_key import engine_fingerprint
from jobs.scheduling import DEFAULT_PRIORITY
from jobs.input.shard_files import check_shard_size, read_shard, write_retry_shards
from jobs.input.shard_sizing import resolve_shard_size
from jobs.several_models import SeveralEngines
from jobs.ledger.statuses import JobStatus
from pipeline.engine_key import engine_key
from pipeline.models.model_dir import is_encoder, vocabulary_size
from pipeline.request import FinishReason


def create_job_from_file(
    Session: sessionmaker[Session], root, path, *, model: str, engine_options: dict,
    shard_size: int | str, limits: Limits = Limits(), metadata: dict | None = None,
    completion_window: str | None = None, api_key_id: str | None = None, **scheduling,
) -> tuple[str, list[int]]:
    """Validate `path`, shard it under the data root (shard_size lines a shard, or "auto":
    jobs.input.shard_sizing) and insert a queued job (owned by api_key_id when the HTTP API
    made it). scheduling: priority, request_timeout_s,
    max_queued_requests, queue (the PIPELINE_QUEUE prefix it is sent on), endpoint (the
    url every OpenAI line must have, else EndpointMismatch), served_names (the names a
    line's body.model may use instead of the model's own: --served-model-name), columns
    (a Parquet table's columns that make its lines: jobs.input.request_source.TableColumns),
    keep_seconds (how long its results are kept once it ended: jobs.results.retention), models
    ([(model, engine options)] of a job of several models: jobs.several_models) and
    models_named_only (a server's batch: the job's models are only those its lines name).

    Returns (job_id, requests per shard). Raises InvalidInput (with every bad line,
    including OpenAI lines naming another model than `model`, or a path that is not a
    regular file) when the file has errors, creating nothing.
    """
    return _create_job(Session, root, new_job_id(), path, model=model, engine_options=engine_options,
                       shard_size=shard_size, limits=limits, metadata=metadata,
                       completion_window=completion_window, api_key_id=api_key_id, **scheduling)


def create_job_from_stream(
    Session: sessionmaker[Session], root, stream: BinaryIO, *, model: str, engine_options: dict,
    shard_size: int | str, limits: Limits = Limits(), metadata: dict | None = None,
    completion_window: str | None = None, **scheduling,
) -> tuple[str, list[int]]:
    """create_job_from_file for a stream (standard input), which can be read only once:
    it is copied into the job's own file (JobPaths.stdin_copy, the job's input_path),
    at most limits.max_file_bytes of it, and that copy is validated and sharded."""
    job_id = new_job_id()
    job_paths = JobPaths(root, job_id)
    copy = job_paths.stdin_copy
    try:
        with atomic_write(copy, "wb") as f:
            size = _copy_at_most(stream, f, limits.max_file_bytes + 1)
        if size > limits.max_file_bytes:
            error = LineError(None, f"standard input has more than {limits.max_file_bytes} bytes, the limit")
            raise InvalidInput(Validation(0, [error], 1, "pipeline", None))
        return _create_job(Session, root, job_id, copy, model=model, engine_options=engine_options,
                           shard_size=shard_size, limits=limits, metadata=metadata,
                           completion_window=completion_window, **scheduling)
    except BaseException:
        _remove_unmade(job_paths)
        raise


def _copy_at_most(src: BinaryIO, dst: BinaryIO, limit: int, chunk: int = 1 << 20) -> int:
    copied = 0
    while copied < limit and (data := src.read(min(chunk, limit - copied))):
        dst.write(data)
        copied += len(data)
    return copied


def _create_job(Session, root, job_id: str, path, *, model: str, engine_options: dict, shard_size: int | str,
                limits: Limits, metadata: dict | None, completion_window: str | None = None,
                api_key_id: str | None = None, priority: str = DEFAULT_PRIORITY,
                request_timeout_s: float | None = None, max_queued_requests: int | None = None,
                queue: str | None = None, endpoint: str | None = None,
                served_names: tuple[str, ...] = (), reuse: bool = True, columns=None,
                keep_seconds: int | None = None, models: list[tuple[str, dict]] | None = None,
                models_named_only: bool = False) -> tuple[str, list[int]]:
    shard_size = resolve_shard_size(shard_size, path)   # "auto": by the work of the file's first lines
    check_shard_size(shard_size)
    several = SeveralEngines(models, served_names) if models and len(models) > 1 else None
    job_paths = JobPaths(root, job_id)
    try:
        limits = with_vocabulary(limits, engine_options) if several is None else several.limits(limits)
        # One pass validates the file and writes its shards; a bad file leaves none.
        validation, shard_sizes = write_input_shards(
            path, job_paths.input_dir, shard_size, limits, columns=columns,
            model=several.names if several is not None else tuple(served_names) or model)
        shard_engines, engine = None, None
        if several is not None:   # each shard one model's lines: its engine's own queue
            shard_sizes, shard_engines = several.group(job_paths.input_dir, len(shard_sizes), shard_size)
            if models_named_only:   # a server's batch: the job's models are those its lines name
                named = several.named(shard_engines)
                if len(named) == 1:   # all of one model: a one-model job, as that model's own server makes
                    engine = several.fingerprint(named[0])
                    (model, engine_options), several, shard_engines = models[named[0]], None, None
                else:
                    several = several.only(named)
        if several is not None:   # the job's own columns are its first model's
            model, engine_options = several.models[0], several.options[0]
        # The engine's fingerprint, on which a shard makes its requests' keys (jobs.reuse.answer_key:
        # the lineage of their rows and, with reuse, what the shard looks up first: jobs.reuse.stored_answers).
        if engine is None:
            engine = engine_fingerprint(engine_options) if several is None else several.fingerprint(0)
        # A pipeline-format file (no endpoint of its own) may be a chat or completions batch, not an embeddings one.
        if endpoint is not None and validation.endpoint != endpoint and (
                validation.endpoint is not None or endpoint == EMBEDDINGS_ENDPOINT):
            raise EndpointMismatch(validation.endpoint or "generation (the pipeline format)", endpoint)
        for options in (several.options if several is not None else [engine_options]):
            check_model_can_answer(validation, options.get("model"))
        check_capacity(Session, validation.num_requests, max_queued_requests)
        with Session() as s:
            scope = None if api_key_id is None else ledger.answer_scope(s, api_key_id)
            ledger.create_job(
                s, job_id=job_id, model=model, engine_options=engine_options,
                engine_key=engine_key(engine_options),
                input_format=validation.input_format, endpoint=validation.endpoint,
                input_path=str(Path(path).resolve()), results_path=str(job_paths.results_dir),
                shard_size=shard_size, shard_sizes=shard_sizes, metadata=metadata,
                completion_window=completion_window, api_key_id=api_key_id, priority=priority,
                request_timeout_s=request_timeout_s, queue=queue, reuse=reuse, engine_fingerprint=engine,
                answer_scope=scope, keep_seconds=keep_seconds, shard_engines=shard_engines,
                models=None if several is None else several.ledger_models())
    except BaseException:
        _remove_unmade(job_paths)
        raise
    return job_id, shard_sizes


def with_vocabulary(limits: Limits, engine_options: dict) -> Limits:
    """limits with the model's vocabulary, where its config is readable here: token ids are
    then checked at submit, each bad one its line's error (none can reach an engine step)."""
    if limits.vocab_size is not None:
        return limits
    return dataclasses.replace(limits, vocab_size=vocabulary_size(engine_options.get("model")))


def check_model_can_answer(validation: Validation, model: str | None) -> None:
    """An encoder only embeds: a generation file for one is refused whole (InvalidInput), not
    failed line by line on a worker."""
    if validation.endpoint != EMBEDDINGS_ENDPOINT and model and is_encoder(Path(model)):
        problem = LineError(None, f"the model {Path(model).name} is an encoder: it embeds and cannot generate; "
                                       "give embedding lines (input) or a generative model")
        raise InvalidInput(Validation(validation.num_requests, [problem], 1, validation.input_format,
                                                validation.endpoint))


def _remove_unmade(job_paths: JobPaths) -> None:
    """Remove a job that was never made: its directory, and <root>/jobs if that is empty now
    (the first job of a data root), so a refused file leaves the data root as it was."""
    shutil.rmtree(job_paths.dir, ignore_errors=True)
    with contextlib.suppress(OSError):   # not empty: other jobs live there
        job_paths.dir.parent.rmdir()


class EndpointMismatch(ValueError):
    """The file's lines are for another endpoint than the batch asks for (`pipeline serve`)."""

    def __init__(self, found: str, wanted: str):
        self.found, self.wanted = found, wanted
        super().__init__(f"the lines are for {found}, not {wanted}")


class OverCapacity(RuntimeError):
    """Queuing a job would put more requests in the queue than PIPELINE_MAX_QUEUED_REQUESTS."""

    def __init__(self, queued: int, wanted: int, limit: int):
        self.queued, self.wanted, self.limit = queued, wanted, limit
        super().__init__(f"{queued} request(s) are queued already; {wanted} more would pass the limit of "
                         f"{limit} (PIPELINE_MAX_QUEUED_REQUESTS)")


def check_capacity(Session: sessionmaker[Session], wanted: int, limit: int | None) -> None:
    """Raise OverCapacity if `wanted` more requests would put the queue over `limit`
    (None: no limit). A job bigger than the limit itself is refused only while anything is
    queued, so it can still run alone."""
    if limit is None:
        return
    with Session() as s:
        queued = ledger.queued_requests(s)
    if queued + wanted > limit and queued > 0:
        raise OverCapacity(queued, wanted, limit)


class NothingToRetry(ValueError):
    """The job has no request to run again (the message says why)."""


def create_retry_job(
    Session: sessionmaker[Session], root, job_id: str, *, shard_size: int | None = None, only_failed: bool = False,
    completion_window: str | None = None, priority: str | None = None, queue: str | None = None,
) -> tuple[str, list[int]]:
    """A new queued job with the requests of the ended job `job_id` that have no answer:
    an error row, a cancelled row, or no row at all (never run: a cancelled or failed
    job's shards that never ran). With only_failed, only the error rows. A request
    answered in job_id is never taken, nor one an earlier retry of job_id already took
    (retry that job for those), so each request runs again from one job only.

    The new job has the same ids, the same normalised lines (so the same parameters)
    read from the input shards, the same model and engine options, and metadata
    {"retry_of": job_id}, and the old job's priority, request timeout, keep and completion window
    (a new window from now) unless priority or completion_window are given (a job of several
    models: the same models, each line on its own again); queue: the
    PIPELINE_QUEUE prefix the new job is sent on (None: run in-process). Returns (new job id, requests per shard). Raises ValueError if
    job_id is malformed, unknown or not ended yet, NothingToRetry if no request is left
    to retry. All or nothing, like create_job_from_file.
    """
    from jobs.results.parquet_files import iter_result_rows

    check_job_id(job_id)
    with Session() as s:
        old = ledger.get_job(s, job_id)
        earlier = ledger.retries_of(s, job_id) if old is not None else []
    if old is None:
        raise ValueError(f"unknown job {job_id!r}")
    if old.status not in JobStatus.terminal():
        raise ValueError(f"job {job_id} is {old.status}; only an ended job can be retried "
                         f"(`pipeline resume {job_id}` finishes it in place)")
    if old.results_expired_at is not None:   # which requests it answered went with its results
        raise ValueError(f"the results of job {job_id} expired at {old.results_expired_at:%Y-%m-%d %H:%M:%S} (its keep "
                         "passed); submit its file again instead")
    shard_size = shard_size or old.shard_size
    check_shard_size(shard_size)
    old_paths = JobPaths(root, job_id)
    answered, unanswered, failed = set(), set(), set()   # a request is answered when all its choices are
    for row in iter_result_rows(old_paths.results_dir, columns=["id", "finish_reason"]):
        reason = FinishReason(row["finish_reason"])
        (answered if reason.is_success else unanswered).add(row["id"])
        if reason.is_failure:
            failed.add(row["id"])
    answered -= unanswered
    taken = {request.id for job in earlier for index in range(job.num_shards)
             for request in read_shard(JobPaths(root, job.id).input_shard(index))}
    num_taken = 0

    def wanted(request_id: str) -> bool:
        nonlocal num_taken
        if request_id in answered or (only_failed and request_id not in failed):
            return False
        num_taken += request_id in taken
        return request_id not in taken

    new_id = new_job_id()
    new_paths = JobPaths(root, new_id)
    try:
        sizes = write_retry_shards(old_paths, old.num_shards, wanted, new_paths.input_dir, shard_size)
        if not sizes:
            raise NothingToRetry(_nothing_to_retry(job_id, only_failed, num_taken, earlier))
        several, shard_engines = SeveralEngines.of_job(old), None
        if several is not None:   # each model's lines in its own shards again, on its own engine
            sizes, shard_engines = several.group(new_paths.input_dir, len(sizes), shard_size)
        with Session() as s:
            ledger.create_job(
                s, job_id=new_id, model=old.model, engine_options=old.engine_options, engine_key=old.engine_key,
                input_format=old.input_format, endpoint=old.endpoint, input_path=old.input_path,
                results_path=str(new_paths.results_dir), shard_size=shard_size, shard_sizes=sizes,
                completion_window=completion_window or old.completion_window, api_key_id=old.api_key_id,
                priority=priority or old.priority, request_timeout_s=old.request_timeout_s, queue=queue,
                # fingerprinted afresh: the retry runs on the model files as they are now
                reuse=old.reuse, engine_fingerprint=(engine_fingerprint(old.engine_options) if several is None
                                                     else several.fingerprint(0)),
                answer_scope=old.answer_scope, keep_seconds=old.keep_seconds, shard_engines=shard_engines,
                models=None if several is None else several.ledger_models(),
                metadata={**(old.metadata_ or {}), "retry_of": job_id})
    except BaseException:
        _remove_unmade(new_paths)
        raise
    return new_id, sizes


def _nothing_to_retry(job_id: str, only_failed: bool, num_taken: int, earlier) -> str:
    if num_taken:
        return (f"the {num_taken} request(s) of job {job_id} left to retry were retried already, as "
                f"{', '.join(job.id for job in earlier)}: retry that job instead")
    if only_failed:
        return f"job {job_id} has no failed requests: nothing to retry"
    return f"every request of job {job_id} has an answer: nothing to retry"
