"""The `pipeline` command line: one click group over thin commands; heavy imports inside them.

job_commands (submit, run, retry, resume, cancel), query_commands (status, list, results),
ops_commands (worker, recover, metrics, db upgrade, bench), api_commands (serve, keys), options (the settings and engine
option bundles), render (what they print), errors (exit codes).
"""
from __future__ import annotations

import click

from pipeline.cli import api_commands, job_commands, ops_commands, query_commands


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
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


for command in (job_commands.submit_command, job_commands.run_command, job_commands.resume_command,
                job_commands.retry_command,
                ops_commands.recover_command, query_commands.status_command, query_commands.list_command,
                query_commands.results_command, job_commands.cancel_command, ops_commands.worker_command,
                ops_commands.metrics_command, ops_commands.db_group, ops_commands.bench_command,
                api_commands.serve_command, api_commands.keys_group):
    main.add_command(command)
