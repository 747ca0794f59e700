"""What a job says about when it runs: its priority and its completion window.

Plain values only (the ledger stores the words; workers.broker turns a priority into the
broker's message priority), so this module knows nothing of Celery or SQL.
"""
from __future__ import annotations

import re
from datetime import timedelta

# Highest first: a worker takes a higher-priority job's shards before a lower one's.
PRIORITIES = ("high", "normal", "low")
DEFAULT_PRIORITY = "normal"
# How the broker carries them (workers.broker): kombu's Redis priority steps, stated for the
# workers and producers alike, and the step each priority is sent with (lower goes first).
PRIORITY_STEPS = [0, 3, 6, 9]
MESSAGE_PRIORITY = {"high": 0, "normal": 3, "low": 6}

# The error code (OpenAI's) of a request a job's completion window left without an answer.
EXPIRED_CODE = "batch_expired"

_WINDOW = re.compile(r"([0-9]{1,12})([smhd])")   # ASCII digits, no spaces: stored and shown as given
# The longest window a job may ask for (OpenAI's batches allow 24h; ours run for longer).
MAX_WINDOW = timedelta(days=30)
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def priority_rank(priority: str | None) -> int:
    """0 for the highest priority; an unknown or missing one ranks as the default."""
    return PRIORITIES.index(priority if priority in PRIORITIES else DEFAULT_PRIORITY)


def parse_window(text: str) -> timedelta:
    """A completion window such as "24h", "8h", "30m", "20s" (or "2d") as a timedelta;
    ValueError for anything else: a window of zero, one longer than MAX_WINDOW, spaces,
    digits other than ASCII 0-9. The CLI and the HTTP API both use this one parser."""
    return parse_duration(text, "a completion window", longest=MAX_WINDOW,
                          longest_text=f"{MAX_WINDOW.days} days ({int(MAX_WINDOW.total_seconds() // 3600)}h)")


# The longest keep of a job's results (`--keep`, PIPELINE_KEEP_RESULTS) and the oldest age
# `pipeline gc` takes: a century, older than any ledger (an age past year 1 cannot even be
# subtracted from today).
CENTURY = timedelta(days=36500)


def parse_keep(text: str) -> int:
    """How long a job's results are kept once it ended ("7d", "12h"), in whole seconds;
    ValueError for anything parse_duration refuses or longer than CENTURY."""
    return int(parse_duration(text, "a keep", longest=CENTURY,
                              longest_text=f"{CENTURY.days}d (a century)").total_seconds())


def parse_duration(text: str, what: str = "a duration", *, longest: timedelta | None = None,
                   longest_text: str | None = None) -> timedelta:
    """A positive whole number of seconds, minutes, hours or days ("30d", "24h", "20s"), at
    most `longest` (said as longest_text): ValueError otherwise, never an OverflowError (12
    digits of days are more than a timedelta holds)."""
    m = _WINDOW.fullmatch(text) if isinstance(text, str) else None
    if not m or int(m[1]) == 0:
        raise ValueError(f"{what} is a positive whole number of seconds, minutes, hours or "
                         f"days, such as 24h, 8h, 30m or 20s; got {text!r}")
    seconds = int(m[1]) * _UNIT_S[m[2]]
    if longest is not None and seconds > longest.total_seconds():
        raise ValueError(f"{what} is at most {longest_text or longest}; got {text!r}")
    try:
        return timedelta(seconds=seconds)
    except OverflowError:
        raise ValueError(f"{what} is too long; got {text!r}") from None


def expired_error(window: str | None) -> str:
    """The error of a result row whose request the job's completion window left unanswered;
    it starts with EXPIRED_CODE, which the OpenAI export reports as the error's code."""
    return f"{EXPIRED_CODE}: the job's completion window ({window}) ended before this request finished"


def error_code(error: str | None) -> str | None:
    """EXPIRED_CODE if a row's error says so, else None."""
    return EXPIRED_CODE if error and error.startswith(f"{EXPIRED_CODE}:") else None
