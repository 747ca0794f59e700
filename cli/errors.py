"""Exit codes, and the exception that ends a command with one."""
from __future__ import annotations

import click

EXIT_JOB_NOT_COMPLETED = 1
EXIT_USAGE = 2
EXIT_BROKER = 3
EXIT_OVER_CAPACITY = 4   # PIPELINE_MAX_QUEUED_REQUESTS: the job was refused, nothing was created
EXIT_INTERRUPTED = 130   # 128 + SIGINT, as a shell reports Ctrl-C
EXIT_TERMINATED = 143    # 128 + SIGTERM


class Fail(click.ClickException):
    """A failure with its own exit code, reported as `Error: message` on stderr."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code
