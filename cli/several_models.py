"""`pipeline submit` / `pipeline run` / `pipeline serve` with --model given several times: a job of
several models (jobs.several_models). Its checks before anything is made, and submit's warning,
per model, when no live worker serves a model's engine (naming the model and the first of its
lines)."""
from __future__ import annotations

import json

import click

from cli.errors import EXIT_USAGE, Fail
from jobs.settings import Settings

_LINES_SHOWN = 5


def several_engines(several_models: list[dict] | None, served_names=()):
    """The job's models (jobs.several_models.SeveralEngines), or None for a job of one model; a
    usage error (exit 2) when they cannot make one job."""
    if several_models is None:
        return None
    from cli.dry_run import check_model
    from jobs.several_models import SeveralEngines
    from pipeline.models.bundled import BUNDLED_NAME

    for options in several_models:
        check_model(options.get("model"))
    try:
        return SeveralEngines([(options.get("model") or BUNDLED_NAME, options) for options in several_models],
                              tuple(served_names))
    except ValueError as e:
        raise Fail(str(e), EXIT_USAGE) from None


def job_models(several) -> list[tuple[str, dict]] | None:
    """The `models` of jobs.submission's create functions: (model, its engine options) of each."""
    return None if several is None else list(zip(several.models, several.options))


def warn_unserved(settings: Settings, Session, job) -> None:
    """For each model of a several-model job that no live worker serves: a warning naming the model,
    the first of its lines, and the worker command that would serve it (the job is kept: its shards
    wait in that model's queue, as a one-model job's do)."""
    from jobs import ledger
    from jobs.ledger.statuses import JobStatus
    from jobs.paths import JobPaths
    from workers.broker import live_workers
    from cli.job_commands import worker_command_for

    if job.status in JobStatus.terminal():
        return
    with Session() as s:
        shards = ledger.get_shards(s, job.id)
    for model in job.models:
        key = model["engine_key"]
        try:
            if live_workers(settings, key):
                continue
        except Exception:   # the broker cannot tell: say nothing, as for one model
            continue
        mine = [shard for shard in shards if shard.engine_key == key]
        if not mine:   # no line names it: nothing waits for it
            continue
        lines = _first_lines(JobPaths(settings.data_dir, job.id), [shard.index for shard in mine])
        options = mine[0].engine_options
        click.echo(f"warning: no live worker serves model {model['model']} (engine {key}; its lines "
                   f"{', '.join(map(str, lines))}{', ...' if len(lines) == _LINES_SHOWN else ''}): they wait in "
                   f"queue {settings.queue_for(key, job.queue)} until one starts, e.g.\n"
                   f"  {worker_command_for(options)}", err=True)


def model_rows(job) -> list[tuple[str, str]]:
    """`pipeline status` rows of a several-model job: one per model, with its figures once it ended
    (jobs.models; the job's model and engine rows are its first model's)."""
    rows = []
    for model in job.models or ():
        figures = (f"{model['completed_requests']} completed, {model['failed_requests']} failed, "
                   f"{model['total_requests']} total; {model['prompt_tokens']} prompt, {model['output_tokens']} "
                   f"output tokens" if "total_requests" in model else "figures once the job ends")
        rows.append((f"model {model['model']}", f"{figures} (engine {model['engine_key']})"))
    return rows


def _first_lines(paths, indexes: list[int]) -> list[int]:
    lines: list[int] = []
    for index in indexes:
        with open(paths.input_shard(index), "rb") as f:
            for raw in f:
                if raw.strip():
                    lines.append(json.loads(raw)["line"])
                    if len(lines) == _LINES_SHOWN:
                        return sorted(lines)
    return sorted(lines)
