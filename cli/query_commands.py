"""Commands that read jobs: status, list, results."""
from __future__ import annotations

import json
from pathlib import Path

import click

from cli import render
from cli.errors import EXIT_USAGE, Fail
from jobs.ledger.statuses import JobStatus, ShardStatus
from cli.job_commands import check_job_id, get_job, sessions, waiting_for_worker, worker_command_for
from cli.options import settings_options
from cli.webhooks import print_deliveries


@click.command("status")
@click.argument("job_id", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print the OpenAI Batch object (a list without JOB).")
@settings_options("broker_url")
def status_command(job_id, as_json, settings):
    """Show one job in detail (and what to do next if it is stuck or has requests left), or all recent jobs."""
    from jobs import ledger

    if job_id:
        check_job_id(job_id)
    Session = sessions(settings)
    with Session() as s:
        jobs = [get_job(s, job_id)] if job_id else ledger.list_jobs(s)
        counts = {job.id: ledger.job_counts(s, job.id) for job in jobs}
        # next_step and the worker check look only at shards held under a lease
        shards = ledger.get_shards(s, job_id, ShardStatus.RUNNING) if job_id else []
        retries = ledger.retries_of(s, job_id) if job_id else []
        usage = ledger.job_usage(s, job_id) if job_id and jobs[0].finished_at is None else None   # so far
    if as_json:
        objects = [render.batch(job, counts[job.id]) for job in jobs]
        click.echo(json.dumps(objects[0] if job_id else {"object": "list", "data": objects}, indent=2))
    elif job_id:
        job, now = jobs[0], ledger.utcnow()
        if not render.held_shards(shards, now) and waiting_for_worker(settings, job):
            render.print_job(job, counts[job_id], f"no live worker serves its engine {job.engine_key}: start one "
                                                  f"with `{worker_command_for(job.engine_options)}`, or "
                                                  f"`pipeline resume {job.id}` finishes it here, in place",
                             waiting=True, usage=usage)
        else:
            render.print_job(job, counts[job_id], render.next_step(job, shards, now, retries), usage=usage)
        print_deliveries(Session, job)
    else:
        render.print_jobs(jobs, waiting=_waiting_for_workers(settings, jobs))


def _waiting_for_workers(settings, jobs) -> set[str]:
    """The ids of the jobs that no live worker will take (one broker query per engine key)."""
    by_key: dict[str, list] = {}
    for job in jobs:
        if job.status not in JobStatus.terminal() and job.engine_key:
            by_key.setdefault(job.engine_key, []).append(job)
    return {job.id for group in by_key.values() if waiting_for_worker(settings, group[0]) for job in group}


@click.command("list")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(min=1))
@settings_options("broker_url")
def list_command(limit, settings):
    """List the newest jobs."""
    from jobs import ledger

    with sessions(settings)() as s:
        jobs = ledger.list_jobs(s, limit)
    render.print_jobs(jobs, waiting=_waiting_for_workers(settings, jobs))


@click.command("results")
@click.argument("job_id")
@click.option("--export", type=click.Path(dir_okay=False), help="Write the results to this JSONL file.")
@click.option("--format", "fmt", type=click.Choice(["pipeline", "openai"]), default="pipeline", show_default=True,
              help="pipeline: our result rows; openai: Batch API output and error files.")
@click.option("--output-file", type=click.Path(dir_okay=False), help="openai format: the output file (or --export).")
@click.option("--error-file", type=click.Path(dir_okay=False),
              help="openai format: the error file  [default: OUTPUT with .errors.jsonl]")
@click.option("--force", is_flag=True, help="Replace export files that already exist (without it they are kept "
                                            "and nothing is written).")
@settings_options()
def results_command(job_id, export, fmt, output_file, error_file, force, settings):
    """Say where a job's Parquet results are, or export them as JSONL.

    An export is written whole or not at all (a reader never sees half a file); missing
    directories are made. An existing file is replaced only with --force, and only if it
    is a regular file: a device, a FIFO, a directory or a symbolic link is never replaced.
    """
    from jobs.atomic_files import TargetExists, TargetRefused
    from jobs.paths import JobPaths

    check_job_id(job_id)
    with sessions(settings)() as s:
        job = get_job(s, job_id)
    job_paths = JobPaths(settings.data_dir, job_id)
    results_dir = job_paths.results_dir
    if note := render.not_ended_note(job):
        click.echo(note, err=True)
    if job.results_expired_at is not None:   # retention deleted them (cli.retention)
        raise Fail(f"the results of job {job_id} expired at {job.results_expired_at:%Y-%m-%d %H:%M:%S} and were deleted")
    if error_file and fmt != "openai":  # the pipeline format has one file; an ignored option would mislead
        raise click.UsageError("--error-file is for --format openai")
    output_file = output_file or export
    if output_file is None:
        if fmt == "openai" or error_file:
            raise click.UsageError("give --export or --output-file")
        render.print_where(job_id, results_dir)
        return
    try:
        if fmt == "pipeline":
            from jobs.results.parquet_files import export_jsonl
            click.echo(f"{export_jsonl(results_dir, output_file, overwrite=force)} rows written to {output_file}")
        else:
            _export_openai(job, job_paths, output_file, error_file or _errors_name(output_file), force)
    except TargetExists as e:
        raise Fail(f"{e}: nothing was written (add --force to replace it)", EXIT_USAGE) from None
    except TargetRefused as e:
        raise Fail(f"{e}: nothing was written", EXIT_USAGE) from None
    except OSError as e:  # e.g. a directory that cannot be made, no permission, a full disk
        raise Fail(f"the export could not be written: {e.strerror or e}: {e.filename or output_file}") from None


def _errors_name(output_file: str) -> str:
    path = Path(output_file)
    return str(path.with_name(path.stem + ".errors.jsonl"))


def _export_openai(job, job_paths, output_file: str, error_file: str, force: bool) -> None:
    from jobs.results.openai_output import PIPELINE_ENDPOINT, write_openai_files
    from jobs.results.parquet_files import iter_job_rows

    created = int((job.finished_at or job.created_at).timestamp())
    rows = iter_job_rows(job_paths, job.num_shards)
    ok, failed = write_openai_files(rows, output_file, error_file,
                                    endpoint=job.endpoint or PIPELINE_ENDPOINT, model=job.model, created=created,
                                    overwrite=force)
    click.echo(f"{ok} responses written to {output_file}, {failed} errors to {error_file}")
