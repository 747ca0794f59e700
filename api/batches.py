"""/v1/batches: create a batch (a job made and queued as `pipeline submit` makes and queues
one), read and list a key's batches, cancel one (as `pipeline cancel` does)."""
from __future__ import annotations

import functools
import re
from pathlib import Path

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, Field

from api.auth import caller
from api.batch_files import output_file_ids
from api.errors import ApiError, not_found
from api.files import invalid_input, owned_file, page
from api.retention import ExpiresAfter
from jobs import ledger
from jobs.input.validation import InvalidInput
from jobs.ledger import JobStatus
from jobs.results.openai_output import batch_object
from jobs.paths import check_job_id, file_path
from jobs.input.field_checks import ENDPOINTS, Bad, storable
from jobs.scheduling import DEFAULT_PRIORITY, PRIORITIES, parse_window
from jobs.submission import EndpointMismatch, OverCapacity, create_job_from_file
from workers.broker import BrokerUnavailable
from workers.submit import EnqueueFailed, NotCancellable, cancel, submit

router = APIRouter()
_FILE_NAME = re.compile(r"file-[0-9a-f]{24}\.jsonl")


class BatchRequest(BaseModel):
    input_file_id: str
    endpoint: str
    completion_window: str
    # OpenAI's limits on metadata: 16 pairs, keys of 64 characters, values of 512.
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    # How long the output and error files are kept from their creation (the batch's end); then
    # they answer 404 and the recovery sweep deletes them with the results. Default: PIPELINE_KEEP_RESULTS.
    output_expires_after: ExpiresAfter | None = None


def _check_storable(body: BatchRequest) -> None:
    """400 for text the ledger cannot store (a NUL, a lone surrogate: jobs.input.field_checks.storable)
    in what is looked up or stored, before anything is: the input file's id and the metadata."""
    try:
        storable("input_file_id", body.input_file_id)
    except Bad as e:
        raise ApiError(400, str(e), param="input_file_id") from None
    for k, v in (body.metadata or {}).items():
        try:
            storable(f"metadata key {k!r}", k)
            storable(f"metadata[{k!r}]", v)
        except Bad as e:
            raise ApiError(400, str(e), param="metadata") from None


def batch_of(config, job: ledger.Job) -> dict:
    """The OpenAI Batch object of a job made through the API, with its file ids."""
    obj = batch_object({**ledger.job_as_dict(job), "total": job.total_requests,
                        "completed": job.completed_requests, "failed": job.failed_requests})
    name = Path(job.input_path).name
    obj["input_file_id"] = name.removesuffix(".jsonl") if _FILE_NAME.fullmatch(name) else None
    obj["output_file_id"] = obj["error_file_id"] = None
    if job.status in JobStatus.terminal():
        obj["output_file_id"], obj["error_file_id"] = output_file_ids(config.Session, config.settings.data_dir, job)
    return obj


def owned_job(request: Request, key: ledger.ApiKey, batch_id: str) -> ledger.Job:
    """The key's job with that id; 404 if it is malformed, unknown or another key's."""
    try:
        check_job_id(batch_id)
    except ValueError:
        raise not_found("Batch", batch_id) from None
    with request.app.state.config.Session() as s:
        job = ledger.get_job(s, batch_id)
    if job is None or job.api_key_id != key.id:
        raise not_found("Batch", batch_id)
    return job


@router.post("/batches")
def create_batch(request: Request, body: BatchRequest, key: ledger.ApiKey = Depends(caller)):
    config = request.app.state.config
    if body.endpoint not in ENDPOINTS:
        raise ApiError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}, got {body.endpoint!r}", param="endpoint")
    try:   # OpenAI's is always "24h"; shorter (or longer) windows are ours
        parse_window(body.completion_window)
    except ValueError as e:
        raise ApiError(400, f"completion_window: {e}", param="completion_window") from None
    _check_storable(body)
    priority = (body.metadata or {}).get("priority", DEFAULT_PRIORITY)
    if priority not in PRIORITIES:
        raise ApiError(400, f"metadata.priority must be one of {', '.join(PRIORITIES)}, got {priority!r}",
                       param="metadata")
    for k, v in (body.metadata or {}).items():
        if len(k) > 64 or len(v) > 512:
            raise ApiError(400, "metadata keys are at most 64 characters, values at most 512", param="metadata")
    upload = owned_file(request, key, body.input_file_id)
    if upload.purpose != "batch":
        raise ApiError(400, f"file {upload.id} has purpose {upload.purpose!r}, not 'batch'", param="input_file_id")
    path = file_path(config.settings.data_dir, upload.id)
    create = functools.partial(
        create_job_from_file, config.Session, config.settings.data_dir, path, model=config.model,
        engine_options=config.engine_options, shard_size=config.shard_size, limits=config.limits,
        metadata=body.metadata, completion_window=body.completion_window, api_key_id=key.id, priority=priority,
        max_queued_requests=config.settings.max_queued_requests or None, queue=config.settings.queue,
        endpoint=body.endpoint, served_names=config.served_names,
        models=None if config.models is None else list(config.models), models_named_only=True,
        keep_seconds=body.output_expires_after.seconds if body.output_expires_after else config.settings.keep_results_s())
    try:
        job = submit(config.settings, config.Session, create)
    except InvalidInput as e:   # it was valid when uploaded: only a new --model can make it invalid
        raise invalid_input(upload.filename, e.validation, "no batch was created") from None
    except FileNotFoundError:   # deleted since it was looked up
        raise not_found("File", upload.id, param="input_file_id") from None
    except EndpointMismatch as e:
        raise ApiError(400, f"the lines of {upload.id} are for {e.found}, not {e.wanted}", param="endpoint") from None
    except BrokerUnavailable as e:
        raise ApiError(503, f"the batch queue is unavailable: {e}") from None
    except OverCapacity as e:
        raise ApiError(429, f"no batch was created: {e}; try again later", code="rate_limit_exceeded") from None
    except EnqueueFailed as e:   # the job can never run: it failed at once, as `pipeline submit`'s does
        raise ApiError(503, f"batch {e.job_id} failed: enqueueing its shards failed: {e.cause}") from None
    return batch_of(config, job)   # the row submit read back once the job was made


@router.get("/batches")
def list_batches(request: Request, key: ledger.ApiKey = Depends(caller), after: str | None = None,
                 limit: int = Query(20, ge=1, le=100)):
    config = request.app.state.config
    cursor = owned_job(request, key, after) if after else None
    with config.Session() as s:
        jobs = ledger.jobs_of_key(s, key.id, after=cursor, limit=limit + 1)
    return page([batch_of(config, job) for job in jobs[:limit]], has_more=len(jobs) > limit)


@router.get("/batches/{batch_id}")
def retrieve_batch(request: Request, batch_id: str, key: ledger.ApiKey = Depends(caller)):
    return batch_of(request.app.state.config, owned_job(request, key, batch_id))


@router.post("/batches/{batch_id}/cancel")
def cancel_batch(request: Request, batch_id: str, key: ledger.ApiKey = Depends(caller)):
    """Queued shards are dropped, running ones stop at their next step; what finished is kept."""
    config = request.app.state.config
    try:
        job = cancel(config.Session, config.settings.data_dir, owned_job(request, key, batch_id))
    except NotCancellable as e:
        raise ApiError(409, f"Cannot cancel a batch with status {e.status!r}.", param="batch_id") from None
    return batch_of(config, job)
