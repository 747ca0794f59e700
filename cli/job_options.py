"""The options the commands that make jobs share (submit, run, retry, serve): shard size (not
retry's: it keeps its old job's), scheduling, served names, reuse, the dry run."""
from __future__ import annotations

import click

from jobs.scheduling import PRIORITIES
from cli.options import AutoOrCount, FiniteFloat


# FILE may be "-": standard input, read once into the job's own copy.
INPUT_FILE = click.Path(exists=True, dir_okay=False, allow_dash=True)
MAX_TIMEOUT_S = 30 * 86400.0   # a request timeout longer than the longest completion window means none


def _check_window(ctx, param, value):
    from jobs.scheduling import parse_window

    if value is not None:
        try:
            parse_window(value)
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
    return value


SHARD_SIZE = click.option(
    "--shard-size", default="auto", show_default=True, type=AutoOrCount(1), metavar="[auto|N]",
    help="Lines a shard holds (the unit a worker leases, commits and retries). auto: by their work, "
         "estimated from the file's first 1000 lines: 256 lines of long generations, up to 2048 of short "
         "1-token or embedding lines in a large job (a shard costs some 30 ms of a worker's time whatever "
         "its size), but no more than leaves the job about 64 shards to spread over workers; 256 for a "
         "Parquet table.")


PRIORITY = click.option("--priority", type=click.Choice(PRIORITIES),
                        help="Workers take higher-priority jobs' shards first (at their next shard "
                             "boundary); within a priority, first in first out.  [default: normal]")
COMPLETION_WINDOW = click.option(
    "--completion-window", callback=_check_window, metavar="WINDOW",
    help="Time the job has, e.g. 24h, 8h, 30m, 20s: once it passes, shards not started never run, "
         "running ones stop at their next step, the job ends `expired`, and every request left "
         "without an answer gets an error row (code batch_expired) that `pipeline retry` runs again.")


REQUEST_TIMEOUT = click.option(
    "--request-timeout", type=FiniteFloat(min=0, min_open=True, max=MAX_TIMEOUT_S), metavar="SECONDS",
    help="A request still running this long after it started ends with finish_reason timeout (an "
         "error row keeping its partial text; its KV blocks are freed). A line's own timeout_s wins.  "
         "[default: none]")


SERVED_MODEL_NAME = click.option(
    "--served-model-name", "served_model_names", multiple=True, metavar="NAME",
    help="A name the lines' body.model may use for the job's model (repeatable: aliases), e.g. "
         "gpt-4o-mini, so that an OpenAI batch file runs unchanged; the output lines report the name "
         "each line used. With several --model: NAME=MODEL, MODEL one of them (as given or by its "
         "directory's name).  [default: the model as given, or its directory's name]")


NO_REUSE = click.option(
    "--no-reuse", is_flag=True,
    help="Compute every request, even those whose answer an earlier job already holds. By default a "
         "deterministic request (greedy, seeded or an embedding) on the same engine and model files is "
         "answered from that job's results (the row's reused_from names it).")


DRY_RUN = click.option(
    "--dry-run", is_flag=True,
    help="Create nothing: validate and tokenize FILE, then say what the job would do: its lines, prompt "
         "tokens (in all, at most), lines too long for the model, requests an earlier job would answer, "
         "the output-token ceiling (max_tokens over every choice) and a duration estimated from the "
         "recent jobs of the same engine (or that there is no history). Exit 2 for a bad file.")
JSON_OUTPUT = click.option("--json", "as_json", is_flag=True, help="With --dry-run: one JSON object.")
