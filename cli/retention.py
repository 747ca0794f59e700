"""Retention on the command line: `--keep` of `pipeline submit` and `pipeline run`, and what
`pipeline status JOB` says of when a job's results go."""
from __future__ import annotations

import click


def _check_keep(ctx, param, value):
    from jobs.scheduling import parse_keep

    if value is None:
        return None
    try:
        return parse_keep(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


KEEP = click.option(
    "--keep", callback=_check_keep, metavar="DURATION",
    help="Keep the job's results this long once it ended, e.g. 7d, 12h (at most 36500d): then the "
         "workers' recovery sweep (or `pipeline recover`) deletes them and their reused-answer index "
         "entries, as `pipeline gc` does; the ledger row stays, with results_expired_at.  "
         "[default: PIPELINE_KEEP_RESULTS, else for ever]")


def keep_seconds(keep: int | None, settings) -> int | None:
    """--keep's seconds, else the settings' default (None: for ever)."""
    return keep if keep is not None else settings.keep_results_s()


def results_line(job) -> tuple[str, str] | None:
    """("results", when they expire or expired) for `pipeline status`; None if kept for ever."""
    from jobs import ledger

    if job.results_expired_at is not None:
        return "results", f"expired {job.results_expired_at:%Y-%m-%d %H:%M:%S} (kept {_days(job.keep_seconds)})"
    if job.keep_seconds is None:
        return None
    at = ledger.results_expire_at(job)
    if at is None:
        return "results", f"kept {_days(job.keep_seconds)} once the job ends"
    return "results", f"expire {at:%Y-%m-%d %H:%M:%S} (kept {_days(job.keep_seconds)})"


def _days(seconds: int | None) -> str:
    if not seconds:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"
