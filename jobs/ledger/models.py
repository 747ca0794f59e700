"""The ledger's tables (jobs, shards, stored answers, webhooks) and the states their rows move through."""
from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import (
    JSON, Boolean, DateTime, Float, ForeignKey, Index, Integer, MetaData, String, Text, TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy import true as sa_true
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from jobs.ledger.statuses import JobStatus, ShardStatus  # noqa: F401  (the states of these rows)

INPUT_FORMATS = ("pipeline", "openai")
# Ledger columns filled from jobs.results.job_stats.compute_stats by finish_job. total_requests is
# left out on purpose: it stays the number of input requests.
STATS_COLUMNS = (
    "completed_requests", "failed_requests", "prompt_tokens", "output_tokens", "cached_tokens",
    "prefix_hit_rate", "draft_tokens", "accepted_tokens", "acceptance_rate",
    "constrained_requests", "constrained_valid", "embedding_vectors", "reused_requests",
    "wall_seconds", "output_tok_s", "total_tok_s", "vectors_s",
    "latency_p50", "latency_p95", "latency_p99", "ttft_p50", "ttft_p95",
    "joules", "tokens_per_joule", "device_seconds", "cost", "energy_unmeasured",
)


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class UTCDateTime(TypeDecorator):
    """Stores UTC and always returns aware datetimes (SQLite would drop the zone)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to the ledger; use an aware UTC datetime")
        value = value.astimezone(timezone.utc)
        # SQLite keeps text without an offset; always-UTC text compares correctly.
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "pk": "pk_%(table_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    })


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String, primary_key=True)
    status: Mapped[str] = mapped_column(String, index=True)
    model: Mapped[str] = mapped_column(String)
    engine_options: Mapped[dict] = mapped_column(JSON)
    # The engine the job needs (pipeline.engine_key): its shards go to that key's queue.
    engine_key: Mapped[str | None] = mapped_column(String, index=True)
    # A job of several models (0017): jobs.several_models' ledger_models, in --model order: each
    # model as given, its engine_options, engine_key, engine_fingerprint and served_names (where
    # given), with its requests and tokens once the job ends; model, engine_options, engine_key and
    # engine_fingerprint above are the first model's. Null for a one-model job. Its shards say
    # which model each runs.
    models: Mapped[list | None] = mapped_column(JSON)
    # The PIPELINE_QUEUE prefix it was submitted on (null: a local job, or one from before
    # 0007): recovery re-sends its shards to `<queue>.<engine_key>`, never another prefix.
    queue: Mapped[str | None] = mapped_column(String)
    input_format: Mapped[str] = mapped_column(String)
    endpoint: Mapped[str | None] = mapped_column(String)
    input_path: Mapped[str] = mapped_column(String)
    results_path: Mapped[str] = mapped_column(String)
    shard_size: Mapped[int] = mapped_column(Integer)
    num_shards: Mapped[int] = mapped_column(Integer)
    completion_window: Mapped[str | None] = mapped_column(String)
    # jobs.scheduling.PRIORITIES: workers take higher-priority jobs' shards first.
    priority: Mapped[str] = mapped_column(String, default="normal", server_default="normal")
    # The timeout of a request line that gives no timeout_s of its own (None: no timeout).
    # Copied to retries; enforced by the engine per request (pipeline.request.Request.timeout_s).
    request_timeout_s: Mapped[float | None] = mapped_column(Float)
    # Answer reuse (jobs.reuse.stored_answers): whether its requests may take stored answers (--no-reuse: not),
    # and the fingerprint of the engine that answers them (the model's files and the options
    # that change answers), in every request key and every result row.
    reuse: Mapped[bool] = mapped_column(Boolean, default=True, server_default=sa_true())
    engine_fingerprint: Mapped[str | None] = mapped_column(String)
    # Whose answers it may reuse and shares its own with (jobs.reuse.answer_key): null for a CLI
    # job (the local scope), else its API key's (ledger.api_keys.answer_scope).
    answer_scope: Mapped[str | None] = mapped_column(String)
    metadata_: Mapped[dict | None] = mapped_column("metadata", JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finalizing_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # Indexed: the webhook sender looks for the jobs that ended lately (jobs.ledger.webhooks).
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, index=True)
    cancelling_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    total_requests: Mapped[int] = mapped_column(Integer, default=0)
    completed_requests: Mapped[int] = mapped_column(Integer, default=0)
    failed_requests: Mapped[int] = mapped_column(Integer, default=0)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    output_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0)        # prompt tokens served from the prefix cache
    prefix_hit_rate: Mapped[float | None] = mapped_column(Float)         # cached_tokens / prompt_tokens
    draft_tokens: Mapped[int] = mapped_column(Integer, default=0)         # speculative decoding's drafts
    accepted_tokens: Mapped[int] = mapped_column(Integer, default=0)      # ... accepted by verification
    acceptance_rate: Mapped[float | None] = mapped_column(Float)         # accepted / drafted
    # Structured-output answers, and those complete under their grammar (the rest are `length`
    # or cut by a stop string: results' valid = false).
    constrained_requests: Mapped[int] = mapped_column(Integer, default=0)
    constrained_valid: Mapped[int] = mapped_column(Integer, default=0)
    embedding_vectors: Mapped[int] = mapped_column(Integer, default=0)   # an embedding job's vectors
    reused_requests: Mapped[int] = mapped_column(Integer, default=0)     # answered from earlier jobs' results
    vectors_s: Mapped[float | None] = mapped_column(Float)               # ... per second of wall time
    wall_seconds: Mapped[float | None] = mapped_column(Float)
    output_tok_s: Mapped[float | None] = mapped_column(Float)
    total_tok_s: Mapped[float | None] = mapped_column(Float)
    latency_p50: Mapped[float | None] = mapped_column(Float)
    latency_p95: Mapped[float | None] = mapped_column(Float)
    latency_p99: Mapped[float | None] = mapped_column(Float)
    ttft_p50: Mapped[float | None] = mapped_column(Float)
    ttft_p95: Mapped[float | None] = mapped_column(Float)
    # Energy and cost (workers.energy), summed over its shards at its end: null where a shard
    # that ran was not measured (energy_unmeasured says why) or no rate was given (cost).
    joules: Mapped[float | None] = mapped_column(Float)
    tokens_per_joule: Mapped[float | None] = mapped_column(Float)   # tokens computed for it / joules
    device_seconds: Mapped[float | None] = mapped_column(Float)
    cost: Mapped[float | None] = mapped_column(Float)
    energy_unmeasured: Mapped[str | None] = mapped_column(Text)
    error: Mapped[str | None] = mapped_column(Text)
    # The API key whose request created the job (`pipeline serve`); null for CLI jobs.
    api_key_id: Mapped[str | None] = mapped_column(ForeignKey("api_keys.id"), index=True)
    # The endpoint `pipeline submit --notify URL` named (null: none; an API batch's endpoint is
    # its key's, found through api_key_id).
    webhook_endpoint_id: Mapped[str | None] = mapped_column(ForeignKey("webhook_endpoints.id"))
    # Retention (jobs.results.retention): how long its results are kept once it ended (--keep, a
    # batch's output_expires_after, PIPELINE_KEEP_RESULTS; null: for ever), and when the recovery
    # sweep deleted them (the row stays, with its counts).
    keep_seconds: Mapped[int | None] = mapped_column(Integer)
    results_expired_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class Shard(Base):
    __tablename__ = "shards"
    __table_args__ = (Index("ix_shards_status_lease", "status", "lease_expires_at"),)

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    index: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    status: Mapped[str] = mapped_column(String)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    releases: Mapped[int] = mapped_column(Integer, default=0)
    num_requests: Mapped[int] = mapped_column(Integer, default=0)
    completed_requests: Mapped[int] = mapped_column(Integer, default=0)
    failed_requests: Mapped[int] = mapped_column(Integer, default=0)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    output_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0)
    draft_tokens: Mapped[int] = mapped_column(Integer, default=0)
    accepted_tokens: Mapped[int] = mapped_column(Integer, default=0)
    worker: Mapped[str | None] = mapped_column(String)
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    error: Mapped[str | None] = mapped_column(Text)
    # What its committed attempt was charged (workers.energy: the busy time between this
    # worker's previous commit and its own): joules from the device's counter (null: none
    # readable, energy_unmeasured says why; energy_meter names the counter), device-seconds,
    # and their cost at the worker's --cost-per-hour (null: no rate).
    joules: Mapped[float | None] = mapped_column(Float)
    device_seconds: Mapped[float | None] = mapped_column(Float)
    cost: Mapped[float | None] = mapped_column(Float)
    energy_meter: Mapped[str | None] = mapped_column(String)
    energy_unmeasured: Mapped[str | None] = mapped_column(Text)
    # The engine of a several-model job's shard (0017): its queue's key, the options a worker builds
    # it from, its fingerprint (its rows' `engine`, its requests' keys). Null: the job's own.
    engine_key: Mapped[str | None] = mapped_column(String)
    engine_options: Mapped[dict | None] = mapped_column(JSON)
    engine_fingerprint: Mapped[str | None] = mapped_column(String)


class Answer(Base):
    """A stored successful answer: the request `request_id` of `job_id` (in its result shard
    `shard`), under the request's key (jobs.reuse.answer_key). Written in the transaction that
    commits the shard; removed with the job's results (`pipeline gc`). Several jobs may hold
    one key: a reuse takes the newest whose results still exist."""
    __tablename__ = "answers"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    request_id: Mapped[str] = mapped_column(String, primary_key=True)
    key: Mapped[str] = mapped_column(String, index=True)
    shard: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class ApiKey(Base):
    """A key of the HTTP API (`pipeline keys`): only its SHA-256 is stored; revoked rows stay,
    so that the jobs and files they owned still name them."""
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String, primary_key=True)
    name: Mapped[str] = mapped_column(String, unique=True)
    key_sha256: Mapped[str] = mapped_column(String, unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # A scope of stored answers it shares with the keys given the same one (--share-answers);
    # null: its answers are its own.
    answer_scope: Mapped[str | None] = mapped_column(String)


class File(Base):
    """A file of the HTTP API under <data root>/files/: an upload (purpose "batch") or a
    batch's output or error file (purpose "batch_output", with the job it came from)."""
    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String, primary_key=True)
    api_key_id: Mapped[str | None] = mapped_column(ForeignKey("api_keys.id"), index=True)
    purpose: Mapped[str] = mapped_column(String)
    filename: Mapped[str] = mapped_column(String)
    bytes: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    # Set when the file was deleted: the row stays (files_of_job still sees it), nothing serves it.
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # When it goes (an upload's expires_after, a batch output's output_expires_after): past it
    # nothing serves it, and the recovery sweep deletes it (jobs.results.retention). Null: never.
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class WebhookEndpoint(Base):
    """Where a job's end is posted, and the secret that signs it: an API key's endpoint
    (`pipeline keys webhook NAME URL`; the one live when a batch ends gets its event) or one
    that CLI jobs name (`pipeline submit --notify URL`: api_key_id null). Rows are never
    deleted, so deliveries still pending keep their URL and secret when a key's is replaced."""
    __tablename__ = "webhook_endpoints"

    id: Mapped[str] = mapped_column(String, primary_key=True)
    url: Mapped[str] = mapped_column(String)
    # Kept as given: every delivery is signed with it (a whsec_... Standard Webhooks secret).
    secret: Mapped[str] = mapped_column(String)
    api_key_id: Mapped[str | None] = mapped_column(ForeignKey("api_keys.id"), index=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    disabled_at: Mapped[datetime | None] = mapped_column(UTCDateTime)   # replaced or removed


class WebhookDelivery(Base):
    """One event (a job's end) to one endpoint: its id is the event's id (webhook-id), one per
    (job, event type, endpoint), and its body is sent byte for byte on every attempt."""
    __tablename__ = "webhook_deliveries"
    __table_args__ = (UniqueConstraint("job_id", "type", "endpoint_id"),
                      Index("ix_webhook_deliveries_status_next", "status", "next_attempt_at"))

    id: Mapped[str] = mapped_column(String, primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    type: Mapped[str] = mapped_column(String)
    endpoint_id: Mapped[str] = mapped_column(ForeignKey("webhook_endpoints.id"))
    payload: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String)
    # Attempts started: the fencing token of the sender that holds it (jobs.ledger.webhooks).
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    last_error: Mapped[str | None] = mapped_column(Text)
    # When it may be tried (next); while one is being sent, when that sender's claim lapses.
    next_attempt_at: Mapped[datetime] = mapped_column(UTCDateTime)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    delivered_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
