"""Commands that make or end jobs: submit, run, retry, cancel."""
from __future__ import annotations

import time

import click

from jobs.settings import Settings
from jobs.states import JobStatus
from pipeline.cli import render
from pipeline.cli.errors import EXIT_BROKER, EXIT_INTERRUPTED, EXIT_JOB_NOT_COMPLETED, EXIT_USAGE, Fail
from pipeline.cli.options import engine_options, settings_options


@click.command("submit")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@engine_options
@click.option("--shard-size", default=256, show_default=True, type=click.IntRange(min=1))
@click.option("--wait", is_flag=True, help="Show progress until the job ends; exit 1 unless it completed.")
@settings_options("broker_url")
def submit_command(file, engine_options, shard_size, wait, settings):
    """Queue FILE as a job for the workers; prints only the job id on stdout."""
    check_broker(settings)  # before creating anything: no job may wait for a broker that is down
    Session = sessions(settings)
    job_id, sizes = _create_job(Session, settings, file, engine_options, shard_size)
    _enqueue_or_abandon(Session, settings, job_id, sizes)
    click.echo(job_id)
    if wait:
        _wait_until_completed(Session, job_id)


@click.command("run")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@engine_options
@click.option("--shard-size", default=256, show_default=True, type=click.IntRange(min=1))
@settings_options("shards_in_flight", "metrics_port")
def run_command(file, engine_options, shard_size, settings):
    """Run FILE here, without Redis or workers (SQLite ledger in the data dir by default)."""
    serve_metrics(settings)
    Session = sessions(settings)
    job_id, sizes = _create_job(Session, settings, file, engine_options, shard_size)
    _run_here(Session, settings, job_id, sizes, engine_options)


@click.command("retry")
@click.argument("job_id")
@click.option("--local", is_flag=True, help="Run the new job here, like `pipeline run`, instead of queueing it.")
@click.option("--shard-size", type=click.IntRange(min=1), help="[default: the old job's]")
@click.option("--wait", is_flag=True, help="Queued: show progress until the job ends; exit 1 unless it completed.")
@settings_options("broker_url", "shards_in_flight")
def retry_command(job_id, local, shard_size, wait, settings):
    """Run the failed requests (finish_reason error) of an ended job again, as a new job.

    The new job has the same request ids, parameters, model and engine options, and
    metadata {"retry_of": JOB}; its id is printed on stdout.
    """
    from jobs import ledger
    from jobs.submission import NothingToRetry, create_retry_job

    check_job_id(job_id)
    if local:
        serve_metrics(settings)   # as `pipeline run` does, when PIPELINE_METRICS_PORT is set
    else:
        check_broker(settings)
    Session = sessions(settings)
    with Session() as s:
        get_job(s, job_id)
    try:
        new_id, sizes = create_retry_job(Session, settings.data_dir, job_id, shard_size=shard_size)
    except NothingToRetry as e:
        raise Fail(str(e), EXIT_JOB_NOT_COMPLETED) from None
    except ValueError as e:
        raise Fail(str(e), EXIT_USAGE) from None
    click.echo(new_id)
    if local:
        with Session() as s:
            options = ledger.get_job(s, new_id).engine_options
        _run_here(Session, settings, new_id, sizes, options)
        return
    _enqueue_or_abandon(Session, settings, new_id, sizes)
    if wait:
        _wait_until_completed(Session, new_id)


@click.command("cancel")
@click.argument("job_id")
@settings_options()
def cancel_command(job_id, settings):
    """Cancel a job: queued shards are dropped, running ones stop at their next step."""
    from jobs import ledger
    from jobs.finalize import finalize_job

    check_job_id(job_id)
    Session = sessions(settings)
    with Session() as s:
        job = get_job(s, job_id)
        cancelled = job.status in (JobStatus.CANCELLING, JobStatus.CANCELLED)
        if not ledger.request_cancel(s, job_id) and not cancelled:
            raise Fail(f"job {job_id} is already {job.status}; it cannot be cancelled")
    finalize_job(Session, settings.data_dir, job_id)  # at once when no shard is running
    with Session() as s:
        click.echo(f"job {job_id}: {ledger.get_job(s, job_id).status}")


# --- shared by the commands ------------------------------------------------------------------

def sessions(settings: Settings):
    """A ledger session factory, the schema brought up to date first."""
    from jobs import ledger
    return ledger.open_sessions(settings.database_url)


def check_job_id(job_id: str) -> str:
    """A malformed job id is a usage error, before it gets near the ledger or a path."""
    from jobs.paths import check_job_id as check

    try:
        return check(job_id)
    except ValueError as e:
        raise Fail(str(e), EXIT_USAGE) from None


def get_job(s, job_id: str):
    from jobs import ledger

    check_job_id(job_id)
    job = ledger.get_job(s, job_id)
    if job is None:
        raise Fail(f"unknown job {job_id!r} (see `pipeline list`)", EXIT_USAGE)
    return job


def serve_metrics(settings: Settings) -> None:
    """The Prometheus endpoint on settings.metrics_port, if set, for as long as this process runs."""
    if not settings.metrics_port:
        return
    from workers import metrics

    try:
        metrics.serve(settings.metrics_port)
    except OSError as e:
        raise Fail(f"cannot serve metrics on port {settings.metrics_port}: {e}", EXIT_USAGE) from None


def check_broker(settings: Settings) -> None:
    from workers.broker import BrokerUnavailable, check_broker as check

    try:
        check(settings.broker_url)
    except BrokerUnavailable as e:
        raise Fail(str(e), EXIT_BROKER) from None


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


def _enqueue_or_abandon(Session, settings: Settings, job_id: str, sizes: list[int]) -> None:
    """Send the job's shards; if that fails the job can never run, so it is failed at once."""
    from jobs.finalize import abandon_job
    from workers.broker import enqueue_job

    try:
        enqueue_job(settings, job_id, len(sizes))
    except Exception as e:
        abandon_job(Session, settings.data_dir, job_id, f"enqueueing the shards failed: {e}")
        raise Fail(f"job {job_id} failed: enqueueing its shards failed: {e}", EXIT_BROKER) from None


def _run_here(Session, settings: Settings, job_id: str, sizes: list[int], engine_options: dict) -> None:
    """Run a created job's shards in this process, with a progress bar and a summary."""
    from workers import local_run

    root = settings.data_dir
    click.echo(f"job {job_id}: {sum(sizes)} requests in {len(sizes)} shard(s)", err=True)
    try:
        with local_run.cancelled_on_interrupt(Session, root, job_id):
            engines = local_run.start_engine(Session, root, job_id, engine_options)
            try:
                with render.Progress(sum(sizes)) as advance:
                    job = local_run.run_shards(Session, root, job_id, len(sizes), engines,
                                               shards_in_flight=settings.shards_in_flight,
                                               on_result=lambda row: advance(row["finish_reason"]))
            finally:
                engines.close()   # the model and KV cache go now, not when the process ends
    except local_run.EngineDidNotStart as e:
        raise Fail(f"job {job_id} failed: {e}", EXIT_JOB_NOT_COMPLETED) from None
    except KeyboardInterrupt:
        raise Fail(f"interrupted: job {job_id} cancelled", EXIT_INTERRUPTED) from None
    render.print_summary(job)
    if job.status != JobStatus.COMPLETED:
        raise Fail(f"job {job_id} ended {job.status}", EXIT_JOB_NOT_COMPLETED)


def _wait_until_completed(Session, job_id: str, poll_s: float = 1.0) -> None:
    """Show a job's progress from the ledger until it ends; Fail unless it completed."""
    from jobs import ledger

    with Session() as s:
        total = ledger.get_job(s, job_id).total_requests
    bar = render.Progress(total)
    with bar:
        while True:
            with Session() as s:
                job = ledger.get_job(s, job_id)
            bar.set(job.completed_requests + job.failed_requests, job.failed_requests)
            if job.status in JobStatus.terminal():
                break
            time.sleep(poll_s)
    if job.status != JobStatus.COMPLETED:
        raise Fail(f"job {job_id} ended {job.status}", EXIT_JOB_NOT_COMPLETED)
