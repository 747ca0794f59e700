"""A real `pipeline worker` subprocess for tests that need one."""
from __future__ import annotations

import contextlib
import signal
import subprocess
import sys


@contextlib.contextmanager
def worker(env, log_path):
    """A `pipeline worker` subprocess, always stopped afterwards (warm, then forced)."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "worker", "--loglevel", "info"],
                                env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
