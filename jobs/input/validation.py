"""What validating an input file finds: its limits, each bad line, and the whole file's outcome.

A file is read in one streaming pass, whole or in line ranges (jobs.input.file_scan); each range's
findings are a `RangeOutcome`, and `complete` joins them into the file's `Validation`,
adding the one check no range can make alone: each id once in the file (jobs.input.unique_ids).
"""
from __future__ import annotations

import heapq
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from jobs.input.unique_ids import IdLog, duplicate_message, duplicates


@dataclass(slots=True)
class Limits:
    """Bounds on an input file; a file breaking one is rejected with a clear error."""
    max_file_bytes: int = 2 * 1024**3
    max_line_bytes: int = 4 * 1024**2
    max_requests: int = 5_000_000
    max_prompt_chars: int = 1_000_000
    max_depth: int = 32
    max_id_chars: int = 512
    max_errors_kept: int = 1000
    # Token ids (prompts, embedding inputs, logit_bias) must be below it: the model's
    # vocabulary when submit can read its config (jobs.submission), else None (unchecked here;
    # the engine still fails such a request alone).
    vocab_size: int | None = None


@dataclass(slots=True)
class LineError:
    """What is wrong with one input line (line is None for file-level problems); unit: what a
    number counts, "line" of a JSONL file or "row" of a Parquet table (jobs.input.parquet_lines)."""
    line: int | None
    message: str
    unit: str = "line"

    def __str__(self) -> str:
        return self.message if self.line is None else f"{self.unit} {self.line}: {self.message}"


@dataclass
class Validation:
    """The outcome of validating a whole file. `errors` holds the first few; `num_errors` counts all."""
    num_requests: int
    errors: list[LineError]
    num_errors: int
    input_format: str               # "pipeline" | "openai"
    endpoint: str | None            # the OpenAI url shared by every line; None for the pipeline format

    @property
    def ok(self) -> bool:
        return self.num_errors == 0

    def report(self, heading: str, shown: int | None = None) -> str:
        """The errors as the CLI prints them and the HTTP API returns them: the heading
        line, then one line each (the first `shown`; all that were kept by default)."""
        errors = self.errors if shown is None else self.errors[:shown]
        lines = [heading, *map(str, errors)]
        if self.num_errors > len(errors):
            lines.append(f"... and {self.num_errors - len(errors)} more")
        return "\n".join(lines)

    def describe(self, name: str, what: str) -> str:
        """Every kept error under `<name>: N error(s), <what>:` (what: what was not done)."""
        return self.report(f"{name}: {self.num_errors} error(s), {what}:")


class InvalidInput(Exception):
    """The input file has errors; `.validation` has them all (up to Limits.max_errors_kept)."""

    def __init__(self, validation: Validation, shown: int = 20):
        self.validation = validation
        super().__init__(validation.report(f"{validation.num_errors} error(s) in the input file:", shown))


@dataclass
class RangeOutcome:
    """What one streaming pass over a range of lines (or the whole file) found, before the
    file-wide id check: its valid requests, request lines, bad lines (the first
    max_errors_kept in full, every one's number), the ids it claimed, and the format and
    endpoint it learned (with the lines that set them)."""
    num_requests: int = 0
    request_lines: int = 0
    errors: list[LineError] = field(default_factory=list)
    num_errors: int = 0
    error_lines: array = field(default_factory=lambda: array("Q"))
    ids: IdLog = field(default_factory=IdLog)
    input_format: str | None = None
    format_line: int | None = None
    endpoint: str | None = None
    endpoint_line: int | None = None
    unit: str = "line"              # what its numbers count: "row" for a Parquet table

    def add_error(self, error: LineError, limits: Limits) -> None:
        self.num_errors += 1
        if error.line is not None:
            self.error_lines.append(error.line)
        if len(self.errors) < limits.max_errors_kept:
            self.errors.append(error)


def complete(outcomes: list[RangeOutcome], limits: Limits,
             ids_of: Callable[[Iterable[int]], dict[int, str]]) -> Validation:
    """The Validation of a file from the outcomes of its ranges, in file order: their
    findings joined, a file with no request refused, and every id claimed twice made an
    error of the later line (added to that line's own problems when it has some).
    ids_of(lines): the ids those lines claimed, read again (only for meeting digests)."""
    first = outcomes[0]
    num_requests = sum(o.num_requests for o in outcomes)
    errors = [e for o in outcomes for e in o.errors][:limits.max_errors_kept]
    num_errors = sum(o.num_errors for o in outcomes)
    if sum(o.request_lines for o in outcomes) == 0:
        errors.append(LineError(None, "the table has no rows" if first.unit == "row" else
                                "the file has no requests (it is empty or has only blank lines)"))
        num_errors += 1
    log = first.ids
    for o in outcomes[1:]:
        log.extend(o.ids)
    found = duplicates(log, ids_of)
    if found:
        bad_lines = {line for o in outcomes for line in o.error_lines}
        kept = {e.line: i for i, e in enumerate(errors) if e.line is not None}
        added: list[LineError] = []   # the lines that were valid but for their id, in line order
        for line, (rid, first_line) in sorted(found.items()):
            message = duplicate_message(rid, first_line, first.unit)
            if line in bad_lines:   # the line's own problems already made it an error: one more problem
                if line in kept:
                    errors[kept[line]] = LineError(line, f"{errors[kept[line]].message}; {message}", first.unit)
                continue
            num_requests -= 1
            num_errors += 1
            if len(added) < limits.max_errors_kept:
                added.append(LineError(line, message, first.unit))
        # One merge by line (a file-level error first), not an insert per duplicate: linear in them.
        errors = list(heapq.merge(errors, added, key=lambda e: e.line or 0))[:limits.max_errors_kept]
    return Validation(num_requests, errors, num_errors, first.input_format or "pipeline", first.endpoint)
