"""What the commands print: job tables, a job's details, progress bars, summaries, the Batch object."""
from __future__ import annotations

import functools
import threading
from pathlib import Path

import click

from jobs.ledger.statuses import JobStatus, ShardStatus
from pipeline.request import FinishReason


@functools.cache
def _console():
    from rich.console import Console
    return Console(stderr=True)


class Progress:
    """A rich progress bar on stderr; entering gives advance(finish_reason)."""

    def __init__(self, total: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[failed]} failed"), TimeElapsedColumn(), console=_console(),
                            refresh_per_second=2)  # a nightly job needs no 10 Hz redraw competing for the CPU
        self.task = self.bar.add_task("requests", total=total, failed=0)
        self.failed = 0
        self._lock = threading.Lock()   # shards in flight report from their own threads

    def __enter__(self):
        self.bar.start()
        return self.advance

    def advance(self, finish_reason: str, n: int = 1) -> None:
        with self._lock:
            self.failed += n if FinishReason(finish_reason).is_failure else 0
            self.bar.update(self.task, advance=n, failed=self.failed)

    def note(self, text: str) -> None:
        """A line above the bar (not markup: worker names may hold brackets)."""
        self.bar.console.print(text, markup=False, highlight=False)

    def set(self, done: int, failed: int) -> None:
        self.failed = failed
        self.bar.update(self.task, completed=done, failed=failed)

    def __exit__(self, *exc):
        self.bar.stop()


def batch(job, counts: dict) -> dict:
    """The OpenAI Batch object of a ledger job, our extra figures under "pipeline"."""
    from jobs.ledger import STATS_COLUMNS, job_as_dict
    from jobs.results.openai_output import batch_object

    d = job_as_dict(job)
    obj = batch_object({**d, "total": job.total_requests, "completed": job.completed_requests,
                        "failed": job.failed_requests})
    extra = {k: d[k] for k in STATS_COLUMNS if k not in ("completed_requests", "failed_requests")}
    obj["pipeline"] = {**extra, "engine_options": job.engine_options, "input_format": job.input_format,
                       "num_shards": job.num_shards, "shards": counts["shards"], "status": job.status,
                       "priority": job.priority, "request_timeout_s": job.request_timeout_s}
    return obj


def print_summary(job) -> None:
    cancelled = job.total_requests - job.completed_requests - job.failed_requests
    click.echo(f"job {job.id}: {job.status}")
    click.echo(f"  requests: {job.completed_requests} completed, {job.failed_requests} failed"
               + (f", {cancelled} not run" if cancelled else "") + f" of {job.total_requests}"
               + (f" ({job.reused_requests} answered from earlier jobs)" if job.reused_requests else ""))
    if job.vectors_s is not None:
        click.echo(f"  throughput: {job.vectors_s:.1f} vectors/s, {job.total_tok_s:.1f} input tok/s "
                   f"over {job.wall_seconds:.1f} s")
    elif job.output_tok_s is not None:
        click.echo(f"  throughput: {job.output_tok_s:.1f} output tok/s, {job.total_tok_s:.1f} total tok/s "
                   f"over {job.wall_seconds:.1f} s")
    if job.joules is not None:   # measured (workers.energy); `pipeline status` says why not
        per_joule = f", {job.tokens_per_joule:.2f} tokens/J" if job.tokens_per_joule else ""
        cost = f"; cost {job.cost:.6g}" if job.cost is not None else ""
        click.echo(f"  energy: {job.joules:.1f} J{per_joule}{cost}")
    click.echo(f"  results: {job.results_path}  (see: pipeline results {job.id})")
    if job.failed_requests:
        click.echo(f"  see the errors: pipeline results {job.id} --export errors.jsonl")


def print_jobs(jobs, waiting: set[str] = frozenset()) -> None:
    """A table of jobs; those in `waiting` show that no live worker serves their engine."""
    from rich.console import Console
    from rich.table import Table

    if not jobs:
        click.echo("no jobs yet: create one with `pipeline run FILE` or `pipeline submit FILE`")
        return
    table = Table("status", "priority", "ok/err/total", "created (UTC)", "deadline (UTC)", "tok/s", "model")
    table.columns[-1].overflow = "ellipsis"
    table.columns[0].no_wrap = True   # "queued (no worker)" reads as one
    table.add_column("job", min_width=20, no_wrap=True)  # ids must stay whole to be copied
    for job in jobs:
        status = f"{job.status} (no worker)" if job.id in waiting else job.status
        table.add_row(status, job.priority, f"{job.completed_requests}/{job.failed_requests}/{job.total_requests}",
                      f"{job.created_at:%Y-%m-%d %H:%M}", deadline(job), _num(job.output_tok_s),
                      Path(job.model).name, job.id)
    Console().print(table)


def held_shards(shards, now) -> list:
    """The shards running under a lease that has not expired: a live process holds them."""
    return [sh for sh in shards if sh.status == ShardStatus.RUNNING and sh.lease_expires_at
            and sh.lease_expires_at >= now]


def next_step(job, shards, now, retries=()) -> str | None:
    """What a user can do about a job that is not moving or has requests left, or None;
    retries: the jobs made by retrying it (ledger.retries_of), oldest first."""
    if job.status not in JobStatus.terminal():
        held = held_shards(shards, now)
        if held:
            return (f"{len(held)} shard(s) running ({', '.join(sorted({sh.worker for sh in held}))}); "
                    f"`pipeline resume {job.id}` would run the others here")
        return (f"no shard of it is running now; if no worker will take it (its `pipeline run` died, or no "
                f"worker is left), `pipeline resume {job.id}` finishes it here, in place")
    unanswered = job.total_requests - job.completed_requests
    if unanswered and retries:   # its unanswered requests went on in a retry: follow that one
        last = retries[-1]
        return (f"{unanswered} request(s) without an answer here were retried as {last.id} ({last.status}): "
                f"`pipeline status {last.id}`")
    if unanswered:
        return (f"{unanswered} request(s) without an answer: `pipeline retry {job.id}` runs them again as a new job "
                "(add --local to run it here, without a broker)")
    return None


def print_job(job, counts: dict, next_step: str | None = None, waiting: bool = False, usage: dict | None = None,
              ) -> None:
    """One job in detail; waiting: no live worker serves its engine; usage: its energy so far
    (jobs.ledger.job_usage) while it runs."""
    from rich.console import Console
    from rich.table import Table

    from cli.energy import energy_rows
    from cli.several_models import model_rows
    from cli.retention import results_line
    from pipeline.engine_key import ran_batch_invariant

    table = Table("field", "value", title=f"job {job.id}")
    status = f"{job.status}, waiting for a worker of its engine" if waiting else job.status
    invariant = ran_batch_invariant(job.engine_options or {}, job.engine_key)
    rows = [("status", status), ("model", job.model), ("engine", job.engine_key or "-"),
            ("batch invariance", "on: greedy and seeded answers do not depend on the rest of the batch"
             if invariant else "off: an answer may differ in its last bits with what shared its batch"),
            ("input", job.input_path), ("results", job.results_path),
            ("requests", f"{job.completed_requests} completed, {job.failed_requests} failed, "
                         f"{job.total_requests} total"
                         + (f", {job.reused_requests} answered from earlier jobs" if job.reused_requests else "")),
            ("shards", ", ".join(f"{n} {st}" for st, n in sorted(counts["shards"].items()))),
            ("tokens", f"{job.prompt_tokens} prompt ({job.cached_tokens or 0} from the prefix cache), "
                       f"{job.output_tokens} output"
                       + (f" ({job.accepted_tokens} of {job.draft_tokens} speculative drafts accepted)"
                          if job.draft_tokens else "")),
            *([("structured", f"{job.constrained_valid} of {job.constrained_requests} constrained answers "
                                f"complete under their grammar (the rest: results' valid = false)")]
              if job.constrained_requests else []),
            *([("embeddings", f"{job.embedding_vectors} vectors, {_num(job.vectors_s)} per second")]
              if job.embedding_vectors else []),
            ("priority", job.priority),
            ("deadline", deadline(job, with_window=True)),
            *([kept] if (kept := results_line(job)) else []),
            ("created", str(job.created_at)), ("started", str(job.started_at)), ("finished", str(job.finished_at)),
            ("wall s", _num(job.wall_seconds)), ("output tok/s", _num(job.output_tok_s)),
            ("latency p50/p95/p99 s", "/".join(_num(v) for v in (job.latency_p50, job.latency_p95, job.latency_p99))),
            ("ttft p50/p95 s", "/".join(_num(v) for v in (job.ttft_p50, job.ttft_p95))),
            *energy_rows(job, usage), *model_rows(job)]
    if job.error:
        rows.append(("error", job.error))
    for row in rows:
        table.add_row(*row)
    Console().print(table)
    if next_step:  # below the table, unwrapped, so that its command can be copied whole
        click.echo(f"next: {next_step}")


def print_where(job_id: str, results_dir: Path) -> None:
    from jobs.paths import RESULT_SHARD_GLOB

    click.echo(f"Results of {job_id}: a Parquet dataset (one file per shard) in\n  {results_dir}\n")
    click.echo("Query it with DuckDB:")
    click.echo(f"  duckdb -c \"SELECT id, output FROM read_parquet('{results_dir}/{RESULT_SHARD_GLOB}')\"")
    click.echo("or pandas:")
    click.echo(f"  pandas.read_parquet('{results_dir}')")
    click.echo(f"or export it: pipeline results {job_id} --export results.jsonl [--format openai]")


def not_ended_note(job) -> str | None:
    """A warning for results read before the job ended."""
    if job.status in JobStatus.terminal():
        return None
    return f"job {job.id} is {job.status}: only the shards committed so far are included"


def deadline(job, now=None, with_window: bool = False) -> str:
    """When a job's completion window ends and the time left, e.g. "2026-12-02 03:00 (1h 5m left)";
    "-" without a window."""
    from jobs.ledger import utcnow

    if job.expires_at is None:
        return "-"
    text = f"{job.expires_at:%Y-%m-%d %H:%M:%S}"
    if with_window:
        text += f" (window {job.completion_window})"
    if job.status in JobStatus.terminal():
        return text
    left = (job.expires_at - (now or utcnow())).total_seconds()
    return f"{text}, {_duration(left)} left" if left > 0 else f"{text}, passed"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h {m:02d}m" if h else f"{m}m {s:02d}s" if m else f"{s}s"


def _num(value) -> str:
    return "-" if value is None else f"{value:.2f}"
