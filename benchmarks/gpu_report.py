"""gpu_check.py's output: one JSON line per result, every line kept for the summary."""
from __future__ import annotations

import json

REPORTED: list[dict] = []


class BudgetExceeded(Exception):
    """The wall-clock budget ran out (SIGALRM): the check in progress stops, the rest are skipped."""


def report(check: str, status: str, **fields) -> dict:
    line = {"check": check, "status": status, **fields}
    print(json.dumps(line, default=str), flush=True)
    REPORTED.append(line)
    return line
