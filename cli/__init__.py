"""The `pipeline` command line: one click group over thin commands; heavy imports inside them.

job_commands (submit, run, retry, resume, cancel), query_commands (status, list, results),
ops_commands (worker, recover, metrics, db upgrade, gc, bench), api_commands (serve, keys), options (the settings and engine
option bundles), render (what they print), errors (exit codes).
"""
from __future__ import annotations

import errno

import click

from cli import api_commands, job_commands, ops_commands, query_commands
from cli.errors import Fail

# Errors of the disk under the data directory or the ledger: one clear line, not a traceback.
_STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO}
_STORAGE_WORDS = ("disk is full", "disk full", "no space left", "read-only", "disk i/o error")


def storage_error(e: BaseException) -> str | None:
    """The message of a full or failing disk anywhere in e's chain of causes, else None."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        message = str(getattr(e, "orig", None) or e).strip()   # SQLAlchemy's: the driver's own
        text = message.splitlines()[0] if message else ""
        if isinstance(e, OSError) and e.errno in _STORAGE_ERRNOS:
            return f"{e.strerror or text}" + (f": {e.filename}" if e.filename else "")
        if type(e).__name__ == "OperationalError" and any(w in text.lower() for w in _STORAGE_WORDS):
            return text
        e = e.__cause__ or e.__context__
    return None


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except Exception as e:
            message = storage_error(e)
            if message is None:
                raise
            raise Fail(f"the disk failed: {message}. Free space (the data directory, the ledger's disk), then "
                       "run the command again; what was committed is kept, and a `pipeline run` cut short is "
                       "finished by `pipeline resume JOB` (`pipeline list` shows it)") from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """Batch LLM inference: submit a JSONL of prompts, get Parquet results and a job ledger.

    \b
    Exit codes:
      0  success (a job that ran to the end is completed even if some requests errored)
      1  the job failed or was cancelled, or the operation failed
      2  bad usage: invalid input file (every bad line is listed), bad option, unknown job
      3  the broker (Redis) is unreachable
      130  `pipeline run`, `resume` or `retry --local` was interrupted (Ctrl-C): its job is
           cancelled, what finished is kept (`pipeline retry JOB` runs the rest)
      143  the same, stopped by SIGTERM
    """
    # Before any thread starts: the engine steps in a thread of its own (see host_memory).
    from pipeline.host_memory import use_one_malloc_arena
    use_one_malloc_arena()
    from jobs.results.arrow_allocator import use_system_allocator   # before pyarrow is imported (see arrow_allocator)
    use_system_allocator()


for command in (job_commands.submit_command, job_commands.run_command, job_commands.resume_command,
                job_commands.retry_command,
                ops_commands.recover_command, query_commands.status_command, query_commands.list_command,
                query_commands.results_command, job_commands.cancel_command, ops_commands.worker_command,
                ops_commands.metrics_command, ops_commands.db_group, ops_commands.gc_command,
                ops_commands.bench_command,
                api_commands.serve_command, api_commands.keys_group):
    main.add_command(command)
