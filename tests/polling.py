"""The one way a test waits for something: poll a predicate until it holds, or fail saying
what it waited for.

    job = wait_until("the job to end", lambda: (j := c.job(job_id)).finished_at and j,
                     diagnostics=c.all_logs)

Every wait in the tests is for a state (a ledger row, a log line, a server answering), never
for a time: the timeout only bounds how long a broken run takes to fail, so it is generous
(a loaded 2-core machine), and a test never asserts that something did not happen by
sleeping first. The helpers that wait for something with a meaning of its own (Cluster's
wait_until_ended, the API tests' wait for a batch) are thin wrappers of wait_until.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

WAIT_S = 150   # the longest any one wait may take before the test fails (a loaded 2-core box)


def wait_until(what: str, predicate: Callable[[], T], timeout: float = WAIT_S, poll_s: float = 0.2,
               diagnostics: Callable[[], str] | str | None = None,
               retry: tuple[type[BaseException], ...] = ()) -> T:
    """predicate()'s first truthy value, asked every poll_s seconds for at most timeout seconds
    (at least once, and once more at the deadline).

    retry: exceptions that mean "not yet" (a server still starting: OSError, say); any other
    propagates at once, as does pytest.fail from the predicate (a process that ended early).
    On timeout an AssertionError names `what`, the last retried exception and diagnostics
    (a string, or a callable giving one when the wait failed: the workers' logs, say)."""
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except retry as error:
            last_error = error
        if time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    message = f"timed out after {timeout:g} s waiting for {what}"
    if last_error is not None:
        message += f" (last error: {last_error!r})"
    text = diagnostics() if callable(diagnostics) else diagnostics
    if text:
        message += f"\n{text}"
    raise AssertionError(message)
