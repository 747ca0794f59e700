"""`--dry-run` of `pipeline submit` and `pipeline run`: jobs.dry_run's figures, printed."""
from __future__ import annotations

import json

import click

from jobs.settings import Settings
from pipeline.cli.errors import EXIT_USAGE, Fail


def report_dry_run(settings: Settings, file, engine_options: dict, served_model_names, reuse: bool,
                   as_json: bool) -> None:
    """Say what the job of FILE would do, creating nothing; a bad file fails as a submit does (exit 2)."""
    from jobs.dry_run import dry_run
    from jobs.spec import InvalidInput

    if file == "-":
        raise Fail("--dry-run needs a file: standard input can be read only once", EXIT_USAGE)
    model = engine_options.get("model")
    try:
        result = dry_run(file, engine_options=engine_options, model_names=tuple(served_model_names) or model,
                         database_url=settings.database_url, root=settings.data_dir, reuse=reuse)
    except InvalidInput as e:
        raise Fail(e.validation.describe(file, "nothing was created (a dry run creates nothing anyway)"),
                   EXIT_USAGE) from None
    if as_json:
        click.echo(json.dumps(result.as_dict()))
        return
    r = result
    click.echo(f"dry run of {file}: nothing was created")
    click.echo(f"  requests: {r.lines} ({r.rows} result rows)")
    click.echo(f"  prompt tokens: {r.prompt_tokens:,} in all, {r.max_prompt_tokens:,} at most")
    click.echo(f"  too long for the model ({r.context_length:,} tokens): {r.over_context}")
    if r.untokenizable:
        click.echo(f"  prompts that cannot be made (they would fail): {r.untokenizable}, the first on "
                   f"{r.first_untokenizable}")
    click.echo(f"  answered from earlier jobs: {r.reused}" + ("" if reuse else " (--no-reuse)"))
    click.echo(f"  output tokens: at most {r.output_token_ceiling:,} (max_tokens over every choice)")
    if r.estimated_s is None:
        click.echo(f"  estimated duration: no history (no completed job of engine {r.engine_key} yet)")
    else:
        click.echo(f"  estimated duration: {r.estimated_s:,.0f} s at {r.throughput_tok_s:,.0f} tok/s (the median "
                   f"of the last {r.history_jobs} completed job(s) of engine {r.engine_key}; the output "
                   f"ceiling counted in full)")
