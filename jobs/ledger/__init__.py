"""The job ledger: SQLAlchemy models for jobs and shards, and the operations on them.

Works on SQLite (the single-machine default) and PostgreSQL (shared by workers on
many machines). Every state transition is one conditional ``UPDATE ... WHERE
<expected state>`` whose rowcount says whether this caller won, so two workers can
never both claim a shard, commit the same shard, or finalize the same job.

Decisions:

* ``Shard.attempt`` is a fencing token: it only ever increases, and renewing or
  committing requires the caller's attempt to be the current one. A graceful
  ``release_shard`` (SIGTERM) increments ``Shard.releases`` instead of decrementing
  the attempt, and ``max_attempts`` counts ``attempt - releases``, so a shutdown does
  not use up an attempt yet a released worker can never commit over its successor.
* While a shard is queued, ``lease_expires_at`` holds when it was last (re)queued: the
  end of its last lease, or when a reconciler last re-enqueued it (``touch_queued``);
  null if neither. ``queued_shards`` uses it to tell how long it has waited.
* Recovery (workers.recovery) is built from conditional updates too (recovery_queries): the reaper's
  ``expired_shards`` and ``take_over_expired``, the reconciler's ``queued_shards`` and
  ``touch_queued``, ``cancel_orphaned_shards``, ``unfinalized_jobs`` and
  ``retake_finalize``; many recovery passes at once each win a given step once.
* OpenAI semantics for the job outcome: a job that ran to the end is ``completed``
  even if some (or all) requests or shards failed — failures are error rows in the
  results. ``failed`` is for the batch itself failing (e.g. the model cannot load),
  decided by the caller of ``finish_job``.
* Timestamps come from the caller's clock (UTC); hosts sharing a PostgreSQL ledger
  need synchronised clocks, with leases much longer than any skew.

The package: models (tables, JobStatus, ShardStatus), database (engines, sessions,
migrations), job_states (the job state machine), shard_leases (claim, renew, release,
commit, fail), recovery_queries (the reaper's and reconciler's steps), conditional (the
conditional UPDATE they all use), progress_queries (read-only counts for monitoring),
api_keys and files (the HTTP API's keys and files), answers (the index of stored answers
that later jobs reuse), retention_queries (results past their keep), webhooks (endpoints, and deliveries claimed and settled as above).
Callers import from `jobs.ledger` itself.
"""
from jobs.ledger.answers import add_answers, any_answers_of, delete_answers, find_answers
from jobs.ledger.api_keys import KeyNameTaken, add_key, answer_scope, find_key, list_keys, revoke_key
from jobs.ledger.database import ensure_schema, make_engine, open_sessions, session_factory, upgrade
from jobs.ledger.job_states import (
    count_error_rows, create_job, expire_if_due, finish_job, get_job, get_shard, get_shards, is_cancelling, job_as_dict, job_counts, jobs_of_key,
    list_jobs, queued_requests, request_cancel, retries_of, stop_reason, try_finalize,
)
from jobs.ledger.files import add_file, delete_file, expired_files, file_expired, files_of_job, get_file, list_files
from jobs.ledger.models import (
    INPUT_FORMATS, STATS_COLUMNS, Answer, ApiKey, Base, File, Job, JobStatus, Shard, ShardStatus, UTCDateTime,
    WebhookDelivery, WebhookEndpoint, utcnow,
)
from jobs.ledger.progress_queries import jobs_by_status, live_engine_keys, live_jobs, live_shards_by_status
from jobs.ledger.recovery_queries import (
    Route, active_jobs, cancel_orphaned_shards, expired_shards, queued_shards, retake_finalize, routes, shard_routes,
    stale_finalizing_jobs, take_over_expired, touch_queued, unfinalized_jobs,
)
from jobs.ledger.retention_queries import mark_results_expired, results_due, results_expire_at
from jobs.ledger.shard_leases import (
    claim_shard, commit_shard, fail_shard, note_shard_error, release_shard, renew_lease,
)
from jobs.ledger.usage import job_usage
from jobs.ledger.webhooks import (
    Claimed, DeliveryStatus, claim_delivery, cli_endpoint, deliveries_of_job, due_deliveries, endpoint_of,
    key_endpoints, mark_delivered, mark_failed_attempt, notify, record_events, remove_key_endpoint, set_key_endpoint,
)

__all__ = [
    "Answer", "ApiKey", "Base", "add_answers", "any_answers_of", "delete_answers", "find_answers", "File", "INPUT_FORMATS", "Job", "JobStatus", "KeyNameTaken", "STATS_COLUMNS", "Shard",
    "ShardStatus", "UTCDateTime", "active_jobs", "add_file", "add_key", "answer_scope", "cancel_orphaned_shards",
    "claim_shard",
    "commit_shard", "count_error_rows", "create_job", "delete_file", "ensure_schema", "expire_if_due", "expired_shards", "fail_shard", "files_of_job",
    "find_key", "finish_job", "get_file", "get_job", "get_shards", "is_cancelling", "job_as_dict", "job_counts",
    "jobs_by_status", "jobs_of_key", "list_files", "list_jobs", "list_keys", "live_engine_keys", "live_jobs", "live_shards_by_status",
    "make_engine", "note_shard_error", "open_sessions", "Route", "routes", "shard_routes", "queued_requests", "queued_shards", "release_shard", "renew_lease", "request_cancel",
    "retake_finalize", "retries_of", "revoke_key", "session_factory", "stale_finalizing_jobs", "stop_reason",
    "take_over_expired", "touch_queued", "try_finalize", "unfinalized_jobs", "upgrade", "utcnow",
    # webhooks
    "Claimed", "DeliveryStatus", "WebhookDelivery", "WebhookEndpoint", "claim_delivery", "cli_endpoint",
    "deliveries_of_job", "due_deliveries", "endpoint_of", "key_endpoints", "mark_delivered", "mark_failed_attempt",
    "notify", "record_events", "remove_key_endpoint", "set_key_endpoint",
    # energy and cost
    "job_usage",
    # retention
    "expired_files", "file_expired", "mark_results_expired", "results_due", "results_expire_at",
]
