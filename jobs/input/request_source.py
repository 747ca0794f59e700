"""Where an input file's requests come from: the lines of a JSONL file, each read as strict
JSON (jobs.input.strict_json), or the rows of a Parquet table, each the JSON object its line
would be (jobs.input.parquet_lines). Either way one stream of (number, object, or the Bad that
says why there is none), numbered from 1 as the user counts them, lines or rows; the checks of
jobs.input.line_checks then judge both alike.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from jobs.input.field_checks import Bad
from jobs.input.file_reading import open_input, read_lines
from jobs.input.strict_json import parse_line
from jobs.input.validation import LineError, Limits

MAGIC = b"PAR1"   # a Parquet file's first 4 bytes (a JSON line never starts so)
Items = Iterator[tuple[int | None, dict | Bad]]   # number None: the file cannot be read on (a table)


@dataclass(frozen=True)
class TableColumns:
    """The columns of a Parquet table that the CLI's options name (None: the default, `id` and `prompt`)."""
    id_column: str | None = None
    prompt_column: str | None = None

    def options(self) -> str:
        given = [name for name, value in (("--id-column", self.id_column), ("--prompt-column", self.prompt_column))
                 if value is not None]
        return " and ".join(given)


def is_parquet(path, f: BinaryIO) -> bool:
    """Whether the opened input is a Parquet file: by its suffix, or by its first bytes
    (`pipeline serve` keeps uploads as .jsonl whatever they hold)."""
    if Path(path).suffix.lower() == ".parquet":
        return True
    at = f.tell()
    f.seek(0)
    head = f.read(len(MAGIC))
    f.seek(at)
    return head == MAGIC


@dataclass
class Source:
    items: Items
    unit: str    # what the numbers count: "line" or "row"


def open_source(path, limits: Limits, columns: TableColumns | None, our_fields,
                span: tuple[int, int | None, int] | None = None) -> tuple[Source | None, LineError | None]:
    """(the input's objects, None) or (None, the file-level problem that refuses it). A JSONL
    file is read from span's start byte (its first line's number) to its end byte; a table whole
    (jobs.input.file_scan never cuts one). our_fields: the fields of a line of our format (the
    columns of those names are read)."""
    f, problem = open_input(path, limits)
    if problem is not None:
        return None, problem
    if not is_parquet(path, f):
        if columns is not None and columns != TableColumns():
            f.close()
            return None, LineError(None, f"{columns.options()} name a Parquet table's columns; {path} is JSON "
                                         "lines, whose lines name their own fields")
        if span is not None:
            f.seek(span[0])
        return Source(parsed_lines(f, limits, *(span[2], span[1]) if span is not None else ()), "line"), None
    from jobs.input.parquet_lines import TableRows   # pyarrow: only for a table (scan children never need it)

    try:
        rows = TableRows(f, columns, our_fields, limits.max_depth)
    except Bad as e:
        f.close()
        return None, LineError(None, str(e))
    return Source(iter(rows), "row"), None


def parsed_lines(f: BinaryIO, limits: Limits, first_line: int = 1, end: int | None = None,
                 wanted: set[int] | None = None) -> Items:
    """(line number, its JSON object or Bad) of each non-blank line from f's position (line
    first_line) to byte `end` (None: the end); with `wanted`, only those lines are parsed and given."""
    for number, raw in read_lines(f, limits.max_line_bytes, first_line, end):
        if wanted is not None and number not in wanted:
            continue
        if raw is None:
            yield number, Bad(f"the line is longer than {limits.max_line_bytes} bytes, the limit")
        elif raw.strip():
            try:
                yield number, parse_line(number, raw, limits.max_depth)
            except Bad as e:
                yield number, e


def objects_of(path, limits: Limits, columns: TableColumns | None, our_fields, wanted: set[int],
               ) -> Iterator[tuple[int, dict]]:
    """(number, object) of the wanted lines or rows of the input, read again (lines whose ids met:
    jobs.input.unique_ids; each made an object the first time, so it does again)."""
    f, problem = open_input(path, limits)
    if problem is not None:
        raise OSError(f"{path} can no longer be read: {problem}")
    if is_parquet(path, f):
        from jobs.input.parquet_lines import TableRows
        items = TableRows(f, columns, our_fields, limits.max_depth)
    else:
        items = parsed_lines(f, limits, wanted=wanted)
    return ((number, obj) for number, obj in items if number in wanted)
