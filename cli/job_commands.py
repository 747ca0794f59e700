"""Commands that make or end jobs: submit, run, retry, resume, cancel."""
from __future__ import annotations

import shlex
import time

import click

from jobs.settings import Settings
from jobs.ledger.statuses import SUBMITTER, JobStatus, ShardStatus
from cli import render
from cli.errors import EXIT_BROKER, EXIT_JOB_NOT_COMPLETED, EXIT_OVER_CAPACITY, EXIT_USAGE, Fail
from cli.dry_run import check_model, report_dry_run
from cli.gpus import GPUS, gpus_for_run
from cli.job_options import (
    COMPLETION_WINDOW, DRY_RUN, INPUT_FILE, JSON_OUTPUT, NO_REUSE, PRIORITY, REQUEST_TIMEOUT, SERVED_MODEL_NAME,
    SHARD_SIZE,
)
from cli.options import job_engine_options, settings_options, table_columns
from cli.several_models import job_models, several_engines, warn_unserved
from cli.retention import KEEP, keep_seconds
from cli.running import run_here, wait_until_completed
from cli.webhooks import notify_options, notifying

CAPACITY_POLL_S = 2.0


@click.command("submit")
@click.argument("file", type=INPUT_FILE)
@job_engine_options
@table_columns
@SHARD_SIZE
@PRIORITY
@COMPLETION_WINDOW
@REQUEST_TIMEOUT
@KEEP
@click.option("--wait-for-capacity", is_flag=True,
              help="When PIPELINE_MAX_QUEUED_REQUESTS would be passed, wait until there is room "
                   "instead of refusing the job (exit 4).")
@click.option("--wait", is_flag=True, help="Show progress until the job ends; exit 1 unless it completed.")
@SERVED_MODEL_NAME
@NO_REUSE
@notify_options
@DRY_RUN
@JSON_OUTPUT
@settings_options("broker_url", "max_queued_requests")
def submit_command(file, engine_options, several_models, columns, shard_size, priority, completion_window,
                   request_timeout, keep, wait_for_capacity, wait, served_model_names, no_reuse, notify, dry_run,
                   as_json, settings):
    """Queue FILE as a job for the workers; prints only the job id on stdout.

    FILE is a regular file, or - to read standard input (once, into the job's own copy).
    With PIPELINE_MAX_QUEUED_REQUESTS set, a job that would queue more requests than that
    is refused (exit 4, nothing created) or, with --wait-for-capacity, waits for room.
    """
    several = several_engines(several_models, served_model_names)
    if dry_run:
        return report_dry_run(settings, file, engine_options, served_model_names, not no_reuse, as_json,
                              engine_here=False, columns=columns, several=several)
    Session = sessions(settings)
    scheduling = dict(priority=priority or "normal", completion_window=completion_window,
                      request_timeout_s=request_timeout, max_queued_requests=settings.max_queued_requests or None,
                      queue=settings.queue, served_names=tuple(served_model_names), reuse=not no_reuse, columns=columns,
                      keep_seconds=keep_seconds(keep, settings), models=job_models(several))
    job = _submit(Session, settings, notifying(Session, notify, lambda: _create_job(
        Session, settings, file, engine_options, shard_size, scheduling, wait_for_capacity=wait_for_capacity)))
    click.echo(job.id)
    if wait:
        wait_until_completed(Session, job.id)


@click.command("run")
@click.argument("file", type=INPUT_FILE)
@job_engine_options
@table_columns
@SHARD_SIZE
@REQUEST_TIMEOUT
@KEEP
@SERVED_MODEL_NAME
@NO_REUSE
@DRY_RUN
@JSON_OUTPUT
@GPUS
@settings_options("shards_in_flight", "tokenizer_processes", "metrics_port", "cost_per_hour")
def run_command(file, engine_options, several_models, columns, shard_size, request_timeout, keep, served_model_names,
                no_reuse, dry_run, as_json, gpus, settings):
    """Run FILE here, without Redis or workers (SQLite ledger in the data dir by default).

    FILE is a regular file, or - to read standard input (once, into the job's own copy).
    Ctrl-C or SIGTERM stops it at the next engine step: what finished is kept, the job is
    cancelled (`pipeline retry JOB --local` runs the rest); a job whose process died
    (SIGKILL, power loss) is finished in place by `pipeline resume JOB`.
    """
    several = several_engines(several_models, served_model_names)
    if dry_run:
        return report_dry_run(settings, file, engine_options, served_model_names, not no_reuse, as_json,
                              engine_here=True, columns=columns, several=several)
    gpu_list = gpus_for_run(gpus, engine_options, settings)   # and the metrics served here, unless per GPU
    Session = sessions(settings)
    job_id, sizes = _create_job(Session, settings, file, engine_options, shard_size,
                                dict(request_timeout_s=request_timeout, served_names=tuple(served_model_names),
                                     reuse=not no_reuse, columns=columns, keep_seconds=keep_seconds(keep, settings),
                                     models=job_models(several)))
    click.echo(f"job {job_id}: {sum(sizes)} requests in {len(sizes)} shard(s)", err=True)
    run_here(Session, settings, job_id, engine_options, gpus=gpu_list)


@click.command("retry")
@click.argument("job_id")
@click.option("--only-failed", is_flag=True, help="Only the requests that failed (finish_reason error or timeout), "
                                                  "not the cancelled or never run ones.")
@click.option("--local", is_flag=True, help="Run the new job here, like `pipeline run`, instead of queueing it.")
@click.option("--shard-size", type=click.IntRange(min=1), help="[default: the old job's]")
@PRIORITY
@COMPLETION_WINDOW
@click.option("--wait", is_flag=True, help="Queued: show progress until the job ends; exit 1 unless it completed.")
@GPUS
@settings_options("broker_url", "shards_in_flight", "tokenizer_processes", "cost_per_hour")
def retry_command(job_id, only_failed, local, shard_size, priority, completion_window, wait, gpus, settings):
    """Run the requests of an ended job that have no answer again, as a new job.

    Those are the failed ones (finish_reason error or timeout), the cancelled ones and the
    ones that never ran (a cancelled or interrupted job). A request answered in JOB is never
    run again, nor one an earlier retry of JOB took already (retry that job instead). The
    new job has the same request ids, parameters, model and engine options, and metadata
    {"retry_of": JOB}; its id is printed on stdout. Exit 1 if nothing is left to retry.
    Its priority, request timeout and completion window are JOB's (the window counted
    from now) unless --priority or --completion-window say otherwise.
    """
    from jobs import ledger
    from jobs.submission import NothingToRetry, create_retry_job

    check_job_id(job_id)
    if gpus is not None and not local:
        raise Fail("--gpus splits a job run here: give it with --local (queued, the workers choose)", EXIT_USAGE)
    Session = sessions(settings)
    with Session() as s:
        get_job(s, job_id)

    def create():
        try:
            return create_retry_job(Session, settings.data_dir, job_id, shard_size=shard_size,
                                    only_failed=only_failed, priority=priority,
                                    completion_window=completion_window, queue=None if local else settings.queue)
        except NothingToRetry as e:
            raise Fail(str(e), EXIT_JOB_NOT_COMPLETED) from None
        except ValueError as e:
            raise Fail(str(e), EXIT_USAGE) from None

    if local:
        new_id, sizes = create()
        click.echo(new_id)
        with Session() as s:
            options = ledger.get_job(s, new_id).engine_options
        click.echo(f"job {new_id}: {sum(sizes)} requests in {len(sizes)} shard(s)", err=True)
        run_here(Session, settings, new_id, options, gpus=gpus_for_run(gpus, options, settings))   # as `pipeline run`
        return
    new_id = _submit(Session, settings, create).id
    click.echo(new_id)
    if wait:
        wait_until_completed(Session, new_id)


@click.command("resume")
@click.argument("job_id")
@GPUS
@settings_options("shards_in_flight", "tokenizer_processes", "metrics_port", "cost_per_hour")
def resume_command(job_id, gpus, settings):
    """Finish an unfinished job here, in place: same job id, no broker or worker needed.

    For a job whose `pipeline run` died (SIGKILL, power loss) or whose workers are gone.
    Committed shards are kept; shards queued, or running under an expired lease, run
    here, leased and fenced as on a worker. A shard that a live worker holds is left to
    it and waited for (taken over here if its lease expires). Ctrl-C or SIGTERM cancel
    the job, as for `pipeline run`. Exit 0 once the job has completed (also if it had).
    """
    from jobs import ledger

    check_job_id(job_id)
    Session = sessions(settings)
    with Session() as s:
        job = get_job(s, job_id)
    if job.status == JobStatus.COMPLETED:
        click.echo(f"job {job_id} has already completed: nothing to resume", err=True)
        render.print_summary(job)
        return
    if job.status in JobStatus.terminal():
        raise Fail(f"job {job_id} is {job.status}: nothing to resume; `pipeline retry {job_id} --local` runs "
                   "its requests without an answer as a new job", EXIT_JOB_NOT_COMPLETED)
    with Session() as s:
        done = sum(sh.status in ShardStatus.terminal() for sh in ledger.get_shards(s, job_id))
    click.echo(f"job {job_id}: resuming here, {done} of {job.num_shards} shard(s) already done "
               f"({job.completed_requests + job.failed_requests} of {job.total_requests} requests)", err=True)
    # One engine per GPU as `pipeline run --gpus` (whose children are this command, one GPU each); metrics as run's.
    run_here(Session, settings, job_id, job.engine_options, gpus=gpus_for_run(gpus, job.engine_options, settings))


@click.command("cancel")
@click.argument("job_id")
@settings_options()
def cancel_command(job_id, settings):
    """Cancel a job: queued shards are dropped, running ones stop at their next step."""
    from workers.submit import NotCancellable, cancel

    check_job_id(job_id)
    Session = sessions(settings)
    with Session() as s:
        job = get_job(s, job_id)
    try:
        job = cancel(Session, settings.data_dir, job)
    except NotCancellable as e:
        raise Fail(str(e)) from None
    click.echo(f"job {job_id}: {job.status}")


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


def _create_job(Session, settings: Settings, file, engine_options: dict, shard_size: int | str,
                scheduling: dict | None = None, wait_for_capacity: bool = False):
    from jobs.input.line_checks import InvalidInput
    from jobs.submission import OverCapacity, create_job_from_file, create_job_from_stream
    from pipeline.models.bundled import BUNDLED_NAME

    check_model(engine_options.get("model"))
    options = dict(model=engine_options.get("model") or BUNDLED_NAME, engine_options=engine_options,
                   shard_size=shard_size, **(scheduling or {}))
    try:
        if file == "-":
            with click.open_file("-", "rb") as stdin:
                return create_job_from_stream(Session, settings.data_dir, stdin, **options)
        said = False
        while True:
            try:
                return create_job_from_file(Session, settings.data_dir, file, **options)
            except OverCapacity as e:
                if not wait_for_capacity:
                    raise
                if not said:
                    click.echo(f"waiting for capacity: {e}", err=True)
                    said = True
                time.sleep(CAPACITY_POLL_S)
    except OverCapacity as e:
        raise Fail(f"job refused, nothing was created: {e}; submit it later, or with --wait-for-capacity",
                   EXIT_OVER_CAPACITY) from None
    except InvalidInput as e:
        name = "standard input" if file == "-" else file
        raise Fail(e.validation.describe(name, "nothing was submitted"), EXIT_USAGE) from None


def _submit(Session, settings: Settings, create):
    """Queue the job `create()` makes (workers.submit, shared with `pipeline serve`); warn
    when no live worker serves its engine."""
    from workers.broker import BrokerUnavailable
    from workers.submit import EnqueueFailed, submit

    try:
        job = submit(settings, Session, create)
    except (BrokerUnavailable, EnqueueFailed) as e:   # before anything was made, or the job failed at once
        raise Fail(str(e), EXIT_BROKER) from None
    if job.reuse and job.completed_requests:   # some shard committed already: by the submit, or a quick worker
        from jobs import ledger

        with Session() as s:
            answered = sum(sh.num_requests for sh in ledger.get_shards(s, job.id, ShardStatus.COMPLETED)
                           if sh.worker == SUBMITTER)
        whole = " (all of it: the job is completed)" if job.status == JobStatus.COMPLETED else ""
        if answered:
            click.echo(f"{answered} of {job.total_requests} request(s) answered at submit from earlier jobs{whole}",
                       err=True)
    if job.models is not None:   # a job of several models: each model's engine
        warn_unserved(settings, Session, job)
    elif waiting_for_worker(settings, job) is True:
        click.echo(f"warning: no live worker serves engine {job.engine_key} (model {job.model}): the job's "
                   f"shards wait in queue {settings.queue_for(job.engine_key, job.queue)} until one starts, e.g.\n"
                   f"  {worker_command_for(job.engine_options)}", err=True)
    return job


def waiting_for_worker(settings: Settings, job) -> bool | None:
    """Whether a job that has not ended waits for a worker of its engine: no live worker
    serves its key (None: the broker cannot tell, the job ended, or it has several models)."""
    from workers.broker import live_workers

    if job.status in JobStatus.terminal() or not job.engine_key or job.models:
        return None
    try:
        return not live_workers(settings, job.engine_key)
    except Exception:
        return None


def worker_command_for(engine_options: dict) -> str:
    """The command that starts a worker for a job's engine (its options that pick the engine)."""
    from pipeline.engine_key import WORKER_FIELDS

    words = ["pipeline", "worker"]
    for name, value in engine_options.items():
        if name not in WORKER_FIELDS and value is not None:
            words += [f"--{name.replace('_', '-')}", str(value)]
    return " ".join(shlex.quote(w) for w in words)
