"""The `pipeline` command line: thin commands over jobs/ and workers/; heavy imports inside them."""
from __future__ import annotations

import functools
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import click

from pipeline.config import DEVICES, DTYPES, QUANTIZATIONS, EngineConfig

EXIT_JOB_NOT_COMPLETED = 1
EXIT_USAGE = 2
EXIT_BROKER = 3
EXIT_INTERRUPTED = 130


class Fail(click.ClickException):
    """A failure with its own exit code, reported as `Error: message` on stderr."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class Settings:
    data_dir: Path
    database_url: str

    def sessions(self):
        """A ledger session factory, the schema brought up to date first."""
        from jobs import ledger
        ledger.ensure_schema(self.database_url)
        return ledger.session_factory(ledger.make_engine(self.database_url))


def with_settings(f):
    """--data-dir and --database-url (PIPELINE_DATA_DIR, PIPELINE_DATABASE_URL), passed as `settings`."""
    @functools.wraps(f)
    def wrapper(*args, data_dir, database_url, **kwargs):
        from jobs.paths import default_database_url
        root = Path(data_dir).resolve()
        return f(*args, settings=Settings(root, database_url or default_database_url(root)), **kwargs)

    wrapper = click.option("--database-url", envvar="PIPELINE_DATABASE_URL", metavar="URL",
                           help="SQLAlchemy URL of the job ledger  [default: SQLite in the data dir]")(wrapper)
    return click.option("--data-dir", envvar="PIPELINE_DATA_DIR", default="./pipeline-data", show_default=True,
                        type=click.Path(file_okay=False), help="Where job inputs and results live.")(wrapper)


def engine_options(f):
    """The engine options, passed as `engine_options`: a dict of the EngineConfig fields given."""
    options = [
        click.option("--model", metavar="DIR",
                     help="Hugging Face model directory  [default: bundled SmolLM2-135M-Instruct]"),
        click.option("--dtype", type=click.Choice(DTYPES)),
        click.option("--device", type=click.Choice(DEVICES)),
        click.option("--quantization", type=click.Choice(QUANTIZATIONS)),
        click.option("--kv-cache-gib", type=float, help="Memory budget of the KV cache."),
        click.option("--max-num-seqs", type=int, help="Most sequences in one batch."),
        click.option("--max-num-batched-tokens", type=int, help="Most tokens in one engine step."),
        click.option("--pack-weights/--no-pack-weights", default=None,
                     help="CPU float32: keep weights in MKL's packed layout (faster decode steps, "
                          "about 3x the float32 weight memory)  [default: on]"),
    ]
    names = ("model", "dtype", "device", "quantization", "kv_cache_gib", "max_num_seqs", "max_num_batched_tokens",
             "pack_weights")

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        given = {name: kwargs.pop(name) for name in names}
        opts = {k: v for k, v in given.items() if v is not None}
        if "model" in opts and Path(opts["model"]).exists():
            opts["model"] = str(Path(opts["model"]).resolve())  # workers may run elsewhere
        try:
            EngineConfig(**opts)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
        return f(*args, engine_options=opts, **kwargs)

    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """Batch LLM inference: submit a JSONL of prompts, get Parquet results and a job ledger.

    \b
    Exit codes:
      0  success (a job that ran to the end is completed even if some requests errored)
      1  the job failed or was cancelled, or the operation failed
      2  bad usage: invalid input file (every bad line is listed), bad option, unknown job
      3  the broker (Redis) is unreachable
      130  `pipeline run` was interrupted (Ctrl-C); its job is cancelled
    """


@main.command("submit")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@engine_options
@click.option("--shard-size", default=256, show_default=True, type=click.IntRange(min=1))
@click.option("--wait", is_flag=True, help="Show progress until the job ends; exit 1 unless it completed.")
@click.option("--broker-url", envvar="PIPELINE_BROKER_URL", default="redis://127.0.0.1:6379/0", show_default=True)
@with_settings
def submit_command(file, engine_options, shard_size, wait, broker_url, settings):
    """Queue FILE as a job for the workers; prints only the job id on stdout."""
    from jobs.finalize import abandon_job
    from workers.tasks import enqueue_job

    _check_broker(broker_url)  # before creating anything: no job may wait for a broker that is down
    Session = settings.sessions()
    job_id, sizes = _create_job(Session, settings, file, engine_options, shard_size)
    try:
        enqueue_job(job_id, len(sizes), broker_url)
    except Exception as e:
        abandon_job(Session, settings.data_dir, job_id, f"enqueueing the shards failed: {e}")
        raise Fail(f"job {job_id} failed: enqueueing its shards failed: {e}", EXIT_BROKER) from None
    click.echo(job_id)
    if wait:
        status = _watch(Session, job_id)
        if status != "completed":
            raise Fail(f"job {job_id} ended {status}", EXIT_JOB_NOT_COMPLETED)


@main.command("run")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@engine_options
@click.option("--shard-size", default=256, show_default=True, type=click.IntRange(min=1))
@with_settings
def run_command(file, engine_options, shard_size, settings):
    """Run FILE here, without Redis or workers (SQLite ledger in the data dir by default)."""
    Session = settings.sessions()
    job_id, sizes = _create_job(Session, settings, file, engine_options, shard_size)
    _run_local(Session, settings, job_id, sizes, engine_options)


@main.command("retry")
@click.argument("job_id")
@click.option("--local", is_flag=True, help="Run the new job here, like `pipeline run`, instead of queueing it.")
@click.option("--shard-size", type=click.IntRange(min=1), help="[default: the old job's]")
@click.option("--wait", is_flag=True, help="Queued: show progress until the job ends; exit 1 unless it completed.")
@click.option("--broker-url", envvar="PIPELINE_BROKER_URL", default="redis://127.0.0.1:6379/0", show_default=True)
@with_settings
def retry_command(job_id, local, shard_size, wait, broker_url, settings):
    """Run the failed requests (finish_reason error) of an ended job again, as a new job.

    The new job has the same request ids, parameters, model and engine options, and
    metadata {"retry_of": JOB}; its id is printed on stdout.
    """
    from jobs.finalize import abandon_job
    from jobs.submission import NothingToRetry, create_retry_job

    _check_job_id(job_id)
    if not local:
        _check_broker(broker_url)
    Session = settings.sessions()
    with Session() as s:
        _get_job(s, job_id)
    try:
        new_id, sizes = create_retry_job(Session, settings.data_dir, job_id, shard_size=shard_size)
    except NothingToRetry as e:
        raise Fail(str(e), EXIT_JOB_NOT_COMPLETED) from None
    except ValueError as e:
        raise Fail(str(e), EXIT_USAGE) from None
    click.echo(new_id)
    if local:
        with Session() as s:
            from jobs import ledger
            options = ledger.get_job(s, new_id).engine_options
        _run_local(Session, settings, new_id, sizes, options)
        return
    from workers.tasks import enqueue_job
    try:
        enqueue_job(new_id, len(sizes), broker_url)
    except Exception as e:
        abandon_job(Session, settings.data_dir, new_id, f"enqueueing the shards failed: {e}")
        raise Fail(f"job {new_id} failed: enqueueing its shards failed: {e}", EXIT_BROKER) from None
    if wait:
        status = _watch(Session, new_id)
        if status != "completed":
            raise Fail(f"job {new_id} ended {status}", EXIT_JOB_NOT_COMPLETED)


@main.command("recover")
@click.option("--max-attempts", envvar="PIPELINE_MAX_ATTEMPTS", default=3, show_default=True,
              type=click.IntRange(min=1), help="Attempts a shard gets (as the workers': PIPELINE_MAX_ATTEMPTS).")
@click.option("--queued-grace", envvar="PIPELINE_QUEUED_GRACE_SECONDS", default=60.0, show_default=True,
              type=click.FloatRange(min=0), help="Re-enqueue shards queued for longer than this (seconds).")
@click.option("--broker-url", envvar="PIPELINE_BROKER_URL", default="redis://127.0.0.1:6379/0", show_default=True)
@with_settings
def recover_command(max_attempts, queued_grace, broker_url, settings):
    """One recovery pass (workers run it every PIPELINE_RECOVERY_INTERVAL s; use this from cron).

    Re-enqueues shards of dead workers and shards the broker lost, writes error rows for
    shards out of attempts, and finalizes jobs left unfinished. Prints what it did as JSON.
    """
    _check_broker(broker_url)
    os.environ["PIPELINE_BROKER_URL"] = broker_url
    from workers.app import app
    from workers.recovery import recover

    app.conf.broker_url = broker_url
    report = recover(settings.sessions(), settings.data_dir, max_attempts=max_attempts, queued_grace_s=queued_grace)
    click.echo(json.dumps(report))
    if report["errors"]:
        raise Fail(f"{len(report['errors'])} recovery step(s) failed (see above)")


@main.command("status")
@click.argument("job_id", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print the OpenAI Batch object (a list without JOB).")
@with_settings
def status_command(job_id, as_json, settings):
    """Show one job in detail, or all recent jobs."""
    from jobs import ledger

    if job_id:
        _check_job_id(job_id)
    Session = settings.sessions()
    with Session() as s:
        jobs = [_get_job(s, job_id)] if job_id else ledger.list_jobs(s)
        counts = {job.id: ledger.job_counts(s, job.id) for job in jobs}
    if as_json:
        objects = [_batch(job, counts[job.id]) for job in jobs]
        click.echo(json.dumps(objects[0] if job_id else {"object": "list", "data": objects}, indent=2))
    elif job_id:
        _print_job(jobs[0], counts[job_id])
    else:
        _print_jobs(jobs)


@main.command("list")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(min=1))
@with_settings
def list_command(limit, settings):
    """List the newest jobs."""
    from jobs import ledger

    with settings.sessions()() as s:
        _print_jobs(ledger.list_jobs(s, limit))


@main.command("results")
@click.argument("job_id")
@click.option("--export", type=click.Path(dir_okay=False), help="Write the results to this JSONL file.")
@click.option("--format", "fmt", type=click.Choice(["pipeline", "openai"]), default="pipeline", show_default=True,
              help="pipeline: our result rows; openai: Batch API output and error files.")
@click.option("--output-file", type=click.Path(dir_okay=False), help="openai format: the output file (or --export).")
@click.option("--error-file", type=click.Path(dir_okay=False),
              help="openai format: the error file  [default: OUTPUT with .errors.jsonl]")
@with_settings
def results_command(job_id, export, fmt, output_file, error_file, settings):
    """Say where a job's Parquet results are, or export them as JSONL."""
    from jobs.ledger import JobStatus
    from jobs.paths import JobPaths

    _check_job_id(job_id)
    with settings.sessions()() as s:
        job = _get_job(s, job_id)
    results_dir = JobPaths(settings.data_dir, job_id).results_dir
    if job.status not in JobStatus.TERMINAL:
        click.echo(f"job {job_id} is {job.status}: only the shards committed so far are included", err=True)
    output_file = output_file or export
    if output_file is None:
        if fmt == "openai" or error_file:
            raise click.UsageError("give --export or --output-file")
        _print_where(job_id, results_dir)
    elif fmt == "pipeline":
        from jobs.results import export_jsonl
        click.echo(f"{export_jsonl(results_dir, output_file)} rows written to {output_file}")
    else:
        _export_openai(job, results_dir, output_file, error_file or _errors_name(output_file))


@main.command("cancel")
@click.argument("job_id")
@with_settings
def cancel_command(job_id, settings):
    """Cancel a job: queued shards are dropped, running ones stop at their next step."""
    from jobs import ledger
    from jobs.finalize import finalize_job

    _check_job_id(job_id)
    Session = settings.sessions()
    with Session() as s:
        job = _get_job(s, job_id)
        if not ledger.request_cancel(s, job_id) and job.status not in ("cancelling", "cancelled"):
            raise Fail(f"job {job_id} is already {job.status}; it cannot be cancelled")
    finalize_job(Session, settings.data_dir, job_id)  # at once when no shard is running
    with Session() as s:
        click.echo(f"job {job_id}: {ledger.get_job(s, job_id).status}")


@main.command("worker")
@click.option("--concurrency", default=1, show_default=True, type=click.IntRange(min=1),
              help="Worker processes; 1 runs shards in this process (solo pool).")
@click.option("--loglevel", default="info", show_default=True)
@click.option("--broker-url", envvar="PIPELINE_BROKER_URL", default="redis://127.0.0.1:6379/0", show_default=True)
@with_settings
def worker_command(concurrency, loglevel, broker_url, settings):
    """Start a Celery worker that runs shards (the engine is built on its first shard)."""
    # Tasks read these from the environment, in this process and in prefork children alike.
    os.environ.update(PIPELINE_DATA_DIR=str(settings.data_dir), PIPELINE_DATABASE_URL=settings.database_url,
                      PIPELINE_BROKER_URL=broker_url)
    from workers.app import app

    app.conf.broker_url = broker_url
    pool = "solo" if concurrency == 1 else "prefork"
    # Workers share nothing but the ledger: no need for gossip, mingle or event heartbeats.
    app.worker_main(["worker", f"--loglevel={loglevel}", f"--concurrency={concurrency}", f"--pool={pool}",
                     "--without-gossip", "--without-mingle", "--without-heartbeat"])


@main.group("db")
def db_group():
    """The job ledger's schema."""


@db_group.command("upgrade")
@with_settings
def db_upgrade_command(settings):
    """Migrate the ledger to the latest schema."""
    from jobs import ledger

    ledger.upgrade(settings.database_url)
    click.echo("the ledger schema is up to date")


@main.command("bench")
@click.argument("requests", type=click.Path(exists=True, dir_okay=False))
@engine_options
def bench_command(requests, engine_options):
    """Time a workload file through the engine; prints one JSON line."""
    from pipeline.bench import run_bench

    try:
        result = run_bench(requests, EngineConfig(**engine_options))
    except ValueError as e:  # a bad workload line
        raise Fail(str(e), EXIT_USAGE) from None
    except RuntimeError as e:  # requests failed, or no GPU for --device cuda
        raise Fail(str(e)) from None
    click.echo(json.dumps(result))


# --- helpers --------------------------------------------------------------------------------

def _create_job(Session, settings: Settings, file, engine_options: dict, shard_size: int):
    from jobs.spec import InvalidInput
    from jobs.submission import create_job_from_file
    from pipeline.bundled import BUNDLED_NAME

    try:
        return create_job_from_file(Session, settings.data_dir, file, model=engine_options.get("model") or BUNDLED_NAME,
                                    engine_options=engine_options, shard_size=shard_size)
    except InvalidInput as e:
        v = e.validation
        lines = [f"{file}: {v.num_errors} error(s), nothing was submitted:", *map(str, v.errors)]
        if v.num_errors > len(v.errors):
            lines.append(f"... and {v.num_errors - len(v.errors)} more")
        raise Fail("\n".join(lines), EXIT_USAGE) from None


def _run_local(Session, settings: Settings, job_id: str, sizes: list[int], engine_options: dict) -> None:
    """Run a created job's shards in this process (`pipeline run`, `pipeline retry --local`)."""
    from jobs import ledger
    from jobs.finalize import abandon_job
    from workers.engine_holder import EngineHolder
    from workers.shard_runner import run_shard

    click.echo(f"job {job_id}: {sum(sizes)} requests in {len(sizes)} shard(s)", err=True)
    engines = EngineHolder()
    worker = f"{socket.gethostname()}:{os.getpid()}"
    try:
        try:
            engines.get(engine_options)  # a model that cannot load fails the job, not each shard
        except Exception as e:
            abandon_job(Session, settings.data_dir, job_id, f"the engine could not start: {e}")
            raise Fail(f"job {job_id} failed: the engine could not start: {e}", EXIT_JOB_NOT_COMPLETED) from None
        with _Progress(sum(sizes)) as advance:
            for index in range(len(sizes)):
                # One attempt: a crash in a shard becomes its error rows and the run goes on.
                run_shard(Session, settings.data_dir, job_id, index, engine_provider=engines.get,
                          worker_name=worker, max_attempts=1, on_result=lambda row: advance(row["finish_reason"]))
    except KeyboardInterrupt:
        with Session() as s:
            ledger.request_cancel(s, job_id)
        abandon_job(Session, settings.data_dir, job_id, "interrupted")
        raise Fail(f"interrupted: job {job_id} cancelled", EXIT_INTERRUPTED) from None
    with Session() as s:
        job = ledger.get_job(s, job_id)
    _print_summary(job)
    if job.status != "completed":
        raise Fail(f"job {job_id} ended {job.status}", EXIT_JOB_NOT_COMPLETED)


def _check_broker(broker_url: str) -> None:
    from workers.tasks import BrokerUnavailable, check_broker

    try:
        check_broker(broker_url)
    except BrokerUnavailable as e:
        raise Fail(str(e), EXIT_BROKER) from None


def _check_job_id(job_id: str) -> str:
    """A malformed job id is a usage error, before it gets near the ledger or a path."""
    from jobs.paths import check_job_id

    try:
        return check_job_id(job_id)
    except ValueError as e:
        raise Fail(str(e), EXIT_USAGE) from None


def _get_job(s, job_id: str):
    from jobs import ledger

    _check_job_id(job_id)
    job = ledger.get_job(s, job_id)
    if job is None:
        raise Fail(f"unknown job {job_id!r} (see `pipeline list`)", EXIT_USAGE)
    return job


def _batch(job, counts: dict) -> dict:
    """The OpenAI Batch object of a ledger job, our extra figures under "pipeline"."""
    from jobs.ledger import STATS_COLUMNS, job_as_dict
    from jobs.openai_format import batch_object

    d = job_as_dict(job)
    batch = batch_object({**d, "total": job.total_requests, "completed": job.completed_requests,
                          "failed": job.failed_requests})
    extra = {k: d[k] for k in STATS_COLUMNS if k not in ("completed_requests", "failed_requests")}
    batch["pipeline"] = {**extra, "engine_options": job.engine_options, "input_format": job.input_format,
                         "num_shards": job.num_shards, "shards": counts["shards"], "status": job.status}
    return batch


@functools.cache
def _console():
    from rich.console import Console
    return Console(stderr=True)


class _Progress:
    """A rich progress bar on stderr; entering gives advance(finish_reason)."""

    def __init__(self, total: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[failed]} failed"), TimeElapsedColumn(), console=_console())
        self.task = self.bar.add_task("requests", total=total, failed=0)
        self.failed = 0

    def __enter__(self):
        self.bar.start()
        return self.advance

    def advance(self, finish_reason: str, n: int = 1) -> None:
        self.failed += n if finish_reason == "error" else 0
        self.bar.update(self.task, advance=n, failed=self.failed)

    def set(self, done: int, failed: int) -> None:
        self.failed = failed
        self.bar.update(self.task, completed=done, failed=failed)

    def __exit__(self, *exc):
        self.bar.stop()


def _watch(Session, job_id: str, poll_s: float = 1.0) -> str:
    """Show a job's progress from the ledger until it ends; returns its final status."""
    from jobs import ledger
    from jobs.ledger import JobStatus

    with Session() as s:
        total = ledger.get_job(s, job_id).total_requests
    bar = _Progress(total)
    with bar:
        while True:
            with Session() as s:
                job = ledger.get_job(s, job_id)
            bar.set(job.completed_requests + job.failed_requests, job.failed_requests)
            if job.status in JobStatus.TERMINAL:
                return job.status
            time.sleep(poll_s)


def _print_summary(job) -> None:
    cancelled = job.total_requests - job.completed_requests - job.failed_requests
    click.echo(f"job {job.id}: {job.status}")
    click.echo(f"  requests: {job.completed_requests} completed, {job.failed_requests} failed"
               + (f", {cancelled} not run" if cancelled else "") + f" of {job.total_requests}")
    if job.output_tok_s is not None:
        click.echo(f"  throughput: {job.output_tok_s:.1f} output tok/s, {job.total_tok_s:.1f} total tok/s "
                   f"over {job.wall_seconds:.1f} s")
    click.echo(f"  results: {job.results_path}  (see: pipeline results {job.id})")
    if job.failed_requests:
        click.echo(f"  see the errors: pipeline results {job.id} --export errors.jsonl")


def _print_jobs(jobs) -> None:
    from rich.console import Console
    from rich.table import Table

    if not jobs:
        click.echo("no jobs yet: create one with `pipeline run FILE` or `pipeline submit FILE`")
        return
    table = Table("status", "ok/err/total", "created (UTC)", "tok/s", "model")
    table.columns[-1].overflow = "ellipsis"
    table.add_column("job", min_width=20, no_wrap=True)  # ids must stay whole to be copied
    for job in jobs:
        table.add_row(job.status, f"{job.completed_requests}/{job.failed_requests}/{job.total_requests}",
                      f"{job.created_at:%Y-%m-%d %H:%M}", _num(job.output_tok_s), Path(job.model).name, job.id)
    Console().print(table)


def _print_job(job, counts: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table("field", "value", title=f"job {job.id}")
    rows = [("status", job.status), ("model", job.model), ("input", job.input_path), ("results", job.results_path),
            ("requests", f"{job.completed_requests} completed, {job.failed_requests} failed, "
                         f"{job.total_requests} total"),
            ("shards", ", ".join(f"{n} {st}" for st, n in sorted(counts["shards"].items()))),
            ("tokens", f"{job.prompt_tokens} prompt, {job.output_tokens} output"),
            ("created", str(job.created_at)), ("started", str(job.started_at)), ("finished", str(job.finished_at)),
            ("wall s", _num(job.wall_seconds)), ("output tok/s", _num(job.output_tok_s)),
            ("latency p50/p95/p99 s", "/".join(_num(v) for v in (job.latency_p50, job.latency_p95, job.latency_p99))),
            ("ttft p50/p95 s", "/".join(_num(v) for v in (job.ttft_p50, job.ttft_p95)))]
    if job.error:
        rows.append(("error", job.error))
    for row in rows:
        table.add_row(*row)
    Console().print(table)


def _num(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def _print_where(job_id: str, results_dir: Path) -> None:
    click.echo(f"Results of {job_id}: a Parquet dataset (one file per shard) in\n  {results_dir}\n")
    click.echo("Query it with DuckDB:")
    click.echo(f"  duckdb -c \"SELECT id, output FROM read_parquet('{results_dir}/shard-*.parquet')\"")
    click.echo("or pandas:")
    click.echo(f"  pandas.read_parquet('{results_dir}')")
    click.echo(f"or export it: pipeline results {job_id} --export results.jsonl [--format openai]")


def _errors_name(output_file: str) -> str:
    path = Path(output_file)
    return str(path.with_name(path.stem + ".errors.jsonl"))


def _export_openai(job, results_dir: Path, output_file: str, error_file: str) -> None:
    from jobs.openai_format import PIPELINE_ENDPOINT, write_openai_files
    from jobs.results import iter_result_rows

    created = int((job.finished_at or job.created_at).timestamp())
    ok, failed = write_openai_files(iter_result_rows(results_dir), output_file, error_file,
                                    endpoint=job.endpoint or PIPELINE_ENDPOINT, model=job.model, created=created)
    click.echo(f"{ok} responses written to {output_file}, {failed} errors to {error_file}")


if __name__ == "__main__":
    main()
