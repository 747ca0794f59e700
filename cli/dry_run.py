"""`--dry-run` of `pipeline submit` and `pipeline run`: jobs.dry_run's figures, printed."""
from __future__ import annotations

import json

import click

from jobs.settings import Settings
from cli.errors import EXIT_USAGE, Fail


def report_dry_run(settings: Settings, file, engine_options: dict, served_model_names, reuse: bool,
                   as_json: bool, engine_here: bool, columns=None, several=None) -> None:
    """Say what the job of FILE would do, creating nothing; a bad file fails as a submit does (exit 2).
    engine_here: the job's engine would be built here from its options (`pipeline run`); a
    submitted job runs on the workers' engines, built from their own (their KV caches are theirs).
    several: a job of several models (jobs.several_models.SeveralEngines): a dry run per model, each
    counting that model's lines."""
    from jobs.dry_run import dry_run
    from jobs.input.line_checks import InvalidInput

    for options in (several.options if several is not None else [engine_options]):
        check_model(options.get("model"))
    if file == "-":
        raise Fail("--dry-run needs a file: standard input can be read only once", EXIT_USAGE)
    model = engine_options.get("model")
    runs = ([(None, engine_options, tuple(served_model_names) or model, None)] if several is None else
            [(name, options, several.names, lambda m, i=i: several.model_of(m) == i)
             for i, (name, options) in enumerate(zip(several.models, several.options))])
    results = []
    try:
        for name, options, names, only in runs:
            results.append((name, dry_run(file, engine_options=options, model_names=names,
                                          database_url=settings.database_url, root=settings.data_dir, reuse=reuse,
                                          engine_here=engine_here, columns=columns, only=only)))
    except InvalidInput as e:
        raise Fail(e.validation.describe(file, "nothing was created (a dry run creates nothing anyway)"),
                   EXIT_USAGE) from None
    if as_json:
        click.echo(json.dumps(results[0][1].as_dict() if several is None else
                              {"models": [{"model": name, **r.as_dict()} for name, r in results]}))
        return
    click.echo(f"dry run of {file}: nothing was created")
    for name, r in results:
        if name is not None:
            click.echo(f"model {name}:")
        _report(r, reuse, engine_here)


def _report(r, reuse: bool, engine_here: bool) -> None:
    click.echo(f"  requests: {r.lines} ({r.rows} result rows)")
    click.echo(f"  prompt tokens: {r.prompt_tokens:,} in all, {r.max_prompt_tokens:,} at most")
    if r.kv_cache_tokens is not None and r.kv_cache_tokens < r.context_length:
        limit = (f"its KV cache holds {r.kv_cache_tokens:,} tokens, prompt plus max_tokens; "
                 f"the model's context is {r.context_length:,}")
    elif r.kv_cache_tokens is not None:
        limit = f"the model's context, {r.context_length:,} tokens; its KV cache holds {r.kv_cache_tokens:,}"
    else:
        limit = (f"the model's context, {r.context_length:,} tokens; "
                 + ("the workers' KV caches" if not engine_here else "its KV cache") + " may hold less")
    click.echo(f"  too long for the engine ({limit}): {r.over_context}")
    if r.untokenizable:
        click.echo(f"  prompts that cannot be made (they would fail): {r.untokenizable}, the first on "
                   f"{r.first_untokenizable}")
    click.echo(f"  answered from earlier jobs: {r.reused}" + ("" if reuse else " (--no-reuse)"))
    click.echo(f"  output tokens: at most {r.output_token_ceiling:,} (max_tokens over every choice)"
               + (f", about {r.expected_output_tokens:,} to compute (answers' lengths as in the last "
                  f"{r.history_answers:,} of the engine's)" if r.history_answers else ""))
    answers = "the ceiling counted in full" if not r.history_answers else "the expected output"
    if r.estimate_basis == "measured here":
        click.echo(f"  estimated duration: {_seconds(r.estimated_s)} (the engine's steps timed here; {answers}; "
                   f"the model's load not counted)")
    elif r.estimate_basis == "history":
        click.echo(f"  estimated duration: {_seconds(r.estimated_s)} at {r.throughput_tok_s:,.0f} tok/s (the median "
                   f"of the last {r.history_jobs} completed job(s) of engine {r.engine_key}; {answers})")
    else:
        click.echo(f"  estimated duration: no history (no completed job of engine {r.engine_key} yet)")


def _seconds(s: float) -> str:
    return f"{s:,.0f} s" if s >= 10 else f"{s:.1f} s"


def check_model(model: str | None) -> None:
    """A model that is not the bundled one must be a loadable local directory: refused here
    (exit 2, nothing created) rather than failing on every worker."""
    from pipeline.models.model_dir import check_model_dir, is_bundled

    if not is_bundled(model):
        try:
            check_model_dir(model)
        except ValueError as e:
            raise Fail(str(e), EXIT_USAGE) from None
