"""The deployment's settings, read once and passed down.

Every PIPELINE_* variable of the deployment, its default and its type are declared here:
the CLI's options take their `envvar=` and defaults from these fields, the Celery app
and its tasks get a Settings object, and jobs/ functions take plain arguments. Plain
values only (a broker URL is a string), so this module knows nothing of Celery.
The engine package reads its own two, as it knows nothing of jobs: PIPELINE_CACHE_DIR
(where the bundled model is converted and the kernels built, pipeline/config.py) and PIPELINE_CPU_KERNELS=0
(the C kernels off, pipeline/kernels).
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

from jobs.paths import default_database_url
from jobs.scheduling import parse_keep


LOG_FORMATS = ("text", "json")


def _setting(env: str, default):
    return field(default=default, metadata={"env": env})


@dataclass(frozen=True, slots=True)
class Settings:
    """data_dir is made absolute; database_url None means the SQLite ledger in data_dir."""
    data_dir: Path = _setting("PIPELINE_DATA_DIR", "./pipeline-data")
    database_url: str | None = _setting("PIPELINE_DATABASE_URL", None)
    broker_url: str = _setting("PIPELINE_BROKER_URL", "redis://127.0.0.1:6379/0")
    queue: str = _setting("PIPELINE_QUEUE", "pipeline")
    lease_s: float = _setting("PIPELINE_LEASE_SECONDS", 60.0)
    max_attempts: int = _setting("PIPELINE_MAX_ATTEMPTS", 3)
    # How long Redis waits for a delivered shard's ack before handing it to another worker.
    visibility_timeout_s: int = _setting("PIPELINE_VISIBILITY_TIMEOUT", 3600)
    recovery_interval_s: float = _setting("PIPELINE_RECOVERY_INTERVAL", 30.0)  # 0: no recovery thread
    queued_grace_s: float = _setting("PIPELINE_QUEUED_GRACE_SECONDS", 60.0)
    # Most shards one engine works on at once (their requests share its batches; each
    # starts once the batch has room): while one drains, the next already runs, so the
    # batch never runs dry at a shard boundary, and small shards fill it together.
    shards_in_flight: int = _setting("PIPELINE_SHARDS_IN_FLIGHT", 8)
    # Processes that tokenize the prompts of an engine's shards (pipeline.engine.tokenizer_pool),
    # beside the engine; 0: its loop thread does, between steps. A chat template renders under
    # the GIL, so a host feeding a fast GPU short requests wants them. "auto": one for an
    # engine on a CUDA GPU, none on a CPU (pipeline.engine.engine_loop.AUTO_TOKENIZER_PROCESSES).
    tokenizer_processes: int | str = _setting("PIPELINE_TOKENIZER_PROCESSES", "auto")
    # The engines a worker serves: a JSON list of engine-option objects (EngineConfig
    # fields), e.g. '[{"model": "/models/a"}]'; empty: the default engine. `pipeline worker
    # --model DIR ...` sets it for the worker it starts. Validated as EngineConfig by the worker (workers.app).
    worker_engines: str = _setting("PIPELINE_WORKER_ENGINES", "")
    # Port of the Prometheus endpoint of a worker or `pipeline run` (0: none).
    metrics_port: int = _setting("PIPELINE_METRICS_PORT", 0)
    # A worker's log lines: "text" (Celery's) or "json" (one object a line, with the shard's ids).
    log_format: str = _setting("PIPELINE_LOG_FORMAT", "text")
    # Most requests queued (in queued shards of live jobs) before `pipeline submit` and
    # `pipeline serve` refuse a new job (0: no limit): back-pressure for a shared night.
    max_queued_requests: int = _setting("PIPELINE_MAX_QUEUED_REQUESTS", 0)
    # The largest file `pipeline serve` accepts in one upload (OpenAI's Batch API limit: 200 MB).
    max_upload_bytes: int = _setting("PIPELINE_MAX_UPLOAD_BYTES", 200 * 1024**2)
    # Seconds before a failed webhook delivery is tried again; each next wait is twice as long
    # (at most an hour), for a day (jobs.webhooks.retry_delay).
    webhook_backoff_s: float = _setting("PIPELINE_WEBHOOK_BACKOFF_SECONDS", 10.0)
    # How long a job's results are kept once it ended when it names no keep of its own
    # (`--keep`, a batch's output_expires_after), e.g. "30d"; empty: for ever (jobs.results.retention).
    keep_results: str = _setting("PIPELINE_KEEP_RESULTS", "")
    # What an hour of a worker's device costs (`--cost-per-hour`, in any currency): a shard's cost is
    # its device-seconds x this / 3600 (workers.energy); unset: no cost is recorded (null).
    cost_per_hour: float | None = _setting("PIPELINE_COST_PER_HOUR", None)
    # Where a CPU's RAPL energy counters are read (<dir>/intel-rapl:N/energy_uj; workers.energy).
    powercap_dir: str = _setting("PIPELINE_POWERCAP_DIR", "/sys/class/powercap")

    def __post_init__(self) -> None:
        # frozen: the normalised values are set once, here
        object.__setattr__(self, "data_dir", Path(self.data_dir).resolve())
        if isinstance(self.cost_per_hour, (str, int)):   # from the environment: a string setting (None default)
            try:
                object.__setattr__(self, "cost_per_hour", float(self.cost_per_hour))
            except ValueError:
                raise ValueError(f"PIPELINE_COST_PER_HOUR must be a number, got {self.cost_per_hour!r}") from None
        if self.cost_per_hour is not None and not (math.isfinite(self.cost_per_hour) and self.cost_per_hour >= 0):
            raise ValueError(f"PIPELINE_COST_PER_HOUR must be a finite number >= 0, got {self.cost_per_hour}")
        if not self.database_url:
            object.__setattr__(self, "database_url", default_database_url(self.data_dir))
        object.__setattr__(self, "tokenizer_processes", tokenizer_processes(self.tokenizer_processes))
        self.served_engine_options()   # a malformed PIPELINE_WORKER_ENGINES fails here, at start-up
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{f.metadata['env']} must be a finite number, got {value}")
        if self.webhook_backoff_s <= 0:
            raise ValueError(f"PIPELINE_WEBHOOK_BACKOFF_SECONDS must be more than 0, got {self.webhook_backoff_s}")
        if self.keep_results:
            try:
                parse_keep(self.keep_results)
            except ValueError as e:
                raise ValueError(f"PIPELINE_KEEP_RESULTS: {e}") from None
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"PIPELINE_LOG_FORMAT must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}")

    def keep_results_s(self) -> int | None:
        """PIPELINE_KEEP_RESULTS in seconds; None: results are kept for ever."""
        return parse_keep(self.keep_results) if self.keep_results else None

    def queue_for(self, engine_key: str, prefix: str | None = None) -> str:
        """The broker queue of one engine key (pipeline.engine_key): `<queue>.<key>`, e.g.
        `pipeline.smollm2-135m-instruct-1a2b3c4d`. Only workers serving that engine consume it.
        prefix: a job's own PIPELINE_QUEUE (the one it was submitted on) instead of ours."""
        return f"{prefix or self.queue}.{engine_key}"

    def served_engine_options(self) -> list[dict]:
        """worker_engines as a list of engine-option dicts: [{}] (the default engine) if unset."""
        if not self.worker_engines.strip():
            return [{}]
        try:
            value = json.loads(self.worker_engines)
        except json.JSONDecodeError as e:
            raise ValueError(f"PIPELINE_WORKER_ENGINES is not JSON: {e}") from None
        if not isinstance(value, list) or not value or not all(isinstance(v, dict) for v in value):
            raise ValueError("PIPELINE_WORKER_ENGINES must be a non-empty JSON list of engine-option objects")
        return value

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ, **overrides) -> "Settings":
        """The variables set (an empty one counts as unset), then `overrides` (e.g. CLI options)."""
        values = {}
        for f in fields(cls):
            raw = environ.get(f.metadata["env"])
            if raw:
                values[f.name] = _parse(f.default, raw)
        return cls(**{**values, **overrides})


def tokenizer_processes(value: int | str) -> int | str:
    """PIPELINE_TOKENIZER_PROCESSES as the engine loop takes it: "auto", or a count >= 0."""
    return auto_or_count(value, 0, "PIPELINE_TOKENIZER_PROCESSES")


def auto_or_count(value: int | str, minimum: int, name: str) -> int | str:
    """A setting that is "auto" or a whole number >= minimum (given as a number or its
    digits); ValueError naming it otherwise."""
    if value == "auto":
        return value
    try:
        count = int(value)
    except (TypeError, ValueError):
        count = minimum - 1
    if count < minimum or isinstance(value, (bool, float)):
        raise ValueError(f'{name} must be "auto" or a whole number >= {minimum}, got {value!r}')
    return count


def env_var(name: str) -> str:
    """The PIPELINE_* variable of the setting `name`."""
    return _field(name).metadata["env"]


def default(name: str):
    """The default of the setting `name`."""
    return _field(name).default


def _field(name: str):
    return next(f for f in fields(Settings) if f.name == name)


def _parse(default_value, raw: str):
    # The default's type is the setting's type (a None default is a string setting).
    return raw if default_value is None else type(default_value)(raw)
