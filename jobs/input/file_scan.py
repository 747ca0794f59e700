"""One pass over a whole input file: validated and, for a new job, written as its input
shards, in line ranges scanned by several processes at once when the file is large.

Why processes: checking a line is Python work (tens of microseconds), so a 1,000,000-line
file would keep one core busy for most of a minute while the others wait.
How it stays one pass with one outcome: the file is cut at line starts into a range per
core (each at least MIN_RANGE_BYTES); the number of each range's first line is counted
beforehand, and the file's start is read until its format and endpoint are known, so every
range checks its lines exactly as a single pass would (line numbers, default ids, a line of
another format or url). Range 0 is scanned here and the others by child processes
(`python -m jobs.input.scan_worker`), each writing its shards into a folder of its own; their
outcomes are joined by jobs.input.validation.complete, which also finds ids used twice across
ranges. A file whose ranges could judge it otherwise than a single pass (more lines than
the request limit; a start that does not settle the format) is scanned in one pass, and so is
a Parquet table (jobs.input.parquet_lines), which has no lines to cut at.
"""
from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from jobs.atomic_files import replace_durably, sync_directory
from jobs.paths import input_shard_name
from jobs.input.shard_files import check_shard_size, shard_line, write_shards
from jobs.input.file_reading import open_input
from jobs.input.line_checks import Scan, _Reader, claimed_ids
from jobs.input.request_source import TableColumns, is_parquet
from jobs.input.validation import InvalidInput, Limits, RangeOutcome, Validation, complete

MIN_RANGE_BYTES = 16 * 1024**2   # below this a child process costs more than it saves
_COUNT_CHUNK = 16 * 1024**2


@dataclass
class RangeTask:
    """One range's work, as it crosses to a child process (pickled)."""
    path: str
    limits: Limits
    model: str | tuple[str, ...] | None
    span: tuple[int, int | None, int]       # start byte, end byte (None: the end of the file), first line
    seed: RangeOutcome | None               # the file's start: its format and endpoint
    shard_dir: str | None = None            # where its shards go (None: validate only)
    shard_size: int = 1
    columns: TableColumns | None = None     # a Parquet table's columns that make its lines


@dataclass
class RangeResult:
    outcome: RangeOutcome
    shard_sizes: list[int]


def scan_range(task: RangeTask) -> RangeResult:
    """Check one range's lines and, with a shard_dir, write its valid requests as shards."""
    scan = Scan(task.path, task.limits, model=task.model, span=task.span, seed=task.seed, columns=task.columns)
    if task.shard_dir is None:
        for _ in scan:
            pass
        return RangeResult(scan.outcome, [])
    sizes = write_shards(map(shard_line, scan), task.shard_dir, task.shard_size)
    return RangeResult(scan.outcome, sizes)


def validate(path, limits: Limits = Limits(), *, model: str | tuple[str, ...] | None = None,
             ranges: int | None = None, columns: TableColumns | None = None) -> Validation:
    """The Validation of the whole file (jobs.input.line_checks.validate's), its ranges scanned in parallel."""
    return _scan_file(path, limits, model, None, 1, ranges, columns)[0]


def write_input_shards(path, shard_dir: str | Path, shard_size: int, limits: Limits = Limits(), *,
                       model: str | tuple[str, ...] | None = None, ranges: int | None = None,
                       columns: TableColumns | None = None) -> tuple[Validation, list[int]]:
    """Validate the input file `path` (against the job's `model`) and shard it, in one
    streaming pass; returns the validation and the shard sizes.
    ranges: how many line ranges to scan at once (None: one a core, for a large file).
    columns: a Parquet table's columns that make its lines (jobs.input.parquet_lines).

    The shards are written into a hidden folder beside shard_dir, renamed to shard_dir
    only once the whole file is valid: InvalidInput (the file has an error) or any other
    failure leaves no shard_dir and no folder.
    """
    check_shard_size(shard_size)
    shard_dir = Path(shard_dir)
    shard_dir.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{shard_dir.name}.", suffix=".partial", dir=shard_dir.parent))
    try:
        validation, sizes = _scan_file(path, limits, model, partial, shard_size, ranges, columns)
        if not validation.ok:
            raise InvalidInput(validation)
        replace_durably(partial, shard_dir)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return validation, sizes


def _scan_file(path, limits: Limits, model, shard_dir: Path | None, shard_size: int,
               ranges: int | None, columns: TableColumns | None = None) -> tuple[Validation, list[int]]:
    path = str(path)
    spans, seed = _plan(path, limits, model, ranges)
    tasks = [RangeTask(path, limits, model, span, seed if i else None,
                       None if shard_dir is None else str(shard_dir / f"range-{i}"), shard_size, columns)
             for i, span in enumerate(spans)]
    children = [_start_child(task) for task in tasks[1:]]
    try:
        results = [scan_range(tasks[0])]
        results += [_finish_child(child, task) for child, task in zip(children, tasks[1:])]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    outcomes = [r.outcome for r in results]
    validation = complete(outcomes, limits, lambda lines: claimed_ids(path, lines, outcomes[0], limits, columns))
    sizes: list[int] = []
    if shard_dir is not None and validation.ok:   # the ranges' shards, renumbered in file order
        for task, result in zip(tasks, results):
            for index in range(len(result.shard_sizes)):
                os.rename(Path(task.shard_dir) / input_shard_name(index), shard_dir / input_shard_name(len(sizes)))
                sizes.append(result.shard_sizes[index])
            if result.shard_sizes:
                Path(task.shard_dir).rmdir()
        sync_directory(shard_dir)
    return validation, sizes


def _plan(path: str, limits: Limits, model, ranges: int | None) -> tuple[list[tuple], RangeOutcome | None]:
    """The spans to scan (start byte, end byte or None, first line) and the outcome of the
    file's start that later ranges go on from; one span covering the file when it is small,
    cannot be read, or may not be split."""
    whole = [(0, None, 1)], None
    f, problem = open_input(path, limits)
    if problem is not None:
        return whole
    with f:
        if is_parquet(path, f):
            return whole
        size = os.fstat(f.fileno()).st_size
        wanted = ranges or min(_cores(), size // MIN_RANGE_BYTES)
        if wanted <= 1:
            return whole
        starts = sorted({_line_start(f, size * k // wanted) for k in range(1, wanted)} - {size})
        first_lines, lines = _line_numbers(f, starts)
    if not starts or lines + 1 > limits.max_requests:   # the request limit is a single pass's count
        return whole
    seed = _file_start(path, limits, model, starts[0])
    if seed is None:
        return whole
    bounds = [0, *starts]
    spans = [(start, end, first) for start, end, first in zip(bounds, [*starts, None], [1, *first_lines])]
    return spans, seed


def _line_start(f, offset: int) -> int:
    """The first line start at or after byte `offset` (the byte after a newline)."""
    if offset == 0:
        return 0
    f.seek(offset - 1)
    while chunk := f.readline(1024**2):
        if chunk.endswith(b"\n"):
            break
    return f.tell()


def _line_numbers(f, starts: list[int]) -> tuple[list[int], int]:
    """The line number at each of `starts` (line starts, ascending), and the file's newlines."""
    f.seek(0)
    numbers, newlines, at = [], 0, 0
    for start in [*starts, None]:
        while start is None or at < start:
            chunk = f.read(_COUNT_CHUNK if start is None else min(_COUNT_CHUNK, start - at))
            if not chunk:
                break
            newlines += chunk.count(b"\n")
            at += len(chunk)
        if start is not None:
            numbers.append(newlines + 1)
    return numbers, newlines


def _file_start(path: str, limits: Limits, model, end: int) -> RangeOutcome | None:
    """The file's format and endpoint as a single pass knows them from its first lines (up to
    byte `end`), or None if those lines leave either open."""
    reader = _Reader(limits, model)
    items, problem = reader.open(path, span=(0, end, 1))
    for _ in items if problem is None else ():
        if reader.input_format is not None and reader.endpoint_line is not None:
            break
    if reader.input_format is None or reader.endpoint_line is None:
        return None
    return RangeOutcome(input_format=reader.input_format, format_line=reader.format_line,
                        endpoint=reader.endpoint, endpoint_line=reader.endpoint_line)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _start_child(task: RangeTask) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-m", "jobs.input.scan_worker"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE)
    child.stdin.write(pickle.dumps(task))
    child.stdin.close()
    return child


def _finish_child(child: subprocess.Popen, task: RangeTask) -> RangeResult:
    data = child.stdout.read()
    if child.wait() != 0 or not data:
        raise RuntimeError(f"scanning {task.path} from line {task.span[2]} in a child process failed "
                           f"(exit status {child.returncode})")
    return pickle.loads(data)


__all__ = ["MIN_RANGE_BYTES", "RangeTask", "scan_range", "validate", "write_input_shards"]
