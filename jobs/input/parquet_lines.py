"""A Parquet table as input: each row read as the JSON line it stands for, so that every check
of a JSONL line (jobs.input.line_checks) applies to it unchanged, numbered as its row (1-based).

Which columns make a line (`line_columns`): the OpenAI batch line's columns custom_id, method,
url and body (body a JSON string or a struct); or our format: a prompt column
(`--prompt-column`, else `prompt`) and/or a `messages` column (a list of {role, content}
structs) or an `input` column (an embedding's), an id column (`--id-column`, else `id`, else
the row's default id), and every column named as one of our format's fields (max_tokens,
temperature, ...). Other columns are not read.
A null is a field left out, in a struct as at the top: Parquet cannot tell a missing field
from a null one, and a line's null counts as left out anyway.

Memory: the file is read through a READ_BUFFER buffer (unbuffered, pyarrow reads a whole
column chunk at once; with pre_buffer, every row group's bytes up front) and decoded a batch
of rows at a time (about BATCH_BYTES of values), so a table of any size or row-group layout
holds one batch; each row goes on to its checks before the next is made. pyarrow is imported
only when a table is read (jobs.input.request_source): scanning JSONL never loads it.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from jobs.input.field_checks import Bad
from jobs.input.request_source import TableColumns
from jobs.input.strict_json import parse_json

OPENAI_COLUMNS = ("custom_id", "method", "url", "body")
READ_BUFFER = 1 << 20
BATCH_BYTES = 16 << 20       # decoded values held at once, from the row groups' sizes
MAX_BATCH_ROWS = 4096

_Convert = Callable[[object, str], object]   # (a to_pylist value, where) -> its JSON value


class TableRows:
    """Iterating yields (row number, its line as a JSON object, or the Bad that says why there
    is none) for each row in file order, and (None, Bad) if the file cannot be read on; closes f.
    Making it reads only the footer: Bad says why the table cannot make lines (a file-level problem)."""

    def __init__(self, f: BinaryIO, columns: TableColumns | None, our_fields, max_depth: int):
        self._f, self._max_depth = f, max_depth
        try:
            self._file = pq.ParquetFile(f, buffer_size=READ_BUFFER, pre_buffer=False)
        except (pa.ArrowException, OSError, ValueError) as e:
            raise Bad(f"the input is not a readable Parquet file ({e})") from None
        schema = self._file.schema_arrow
        self.columns = line_columns(schema, columns or TableColumns(), our_fields)   # line field -> column
        self._convert = {key: _converter(schema.field(name).type) for key, name in self.columns.items()}
        for key, name in self.columns.items():
            if (depth := 1 + _depth(schema.field(name).type)) > max_depth:
                raise Bad(f"the column {name!r} ({schema.field(name).type}) nests {depth} levels with its row; "
                          f"a line may nest {max_depth}")

    def __iter__(self) -> Iterator[tuple[int | None, dict | Bad]]:
        number = 0
        names = list(dict.fromkeys(self.columns.values()))
        with self._f:
            try:
                for batch in self._file.iter_batches(batch_size=self._batch_rows(), columns=names, use_threads=False):
                    values = [(key, batch.column(name).to_pylist()) for key, name in self.columns.items()]
                    for i in range(batch.num_rows):
                        number += 1
                        try:
                            yield number, self._line({key: column[i] for key, column in values})
                        except Bad as e:
                            yield number, e
            except (pa.ArrowException, OSError) as e:   # a corrupt page: the rows before it were checked
                yield None, Bad(f"the Parquet file cannot be read past row {number} ({e})")

    def _line(self, values: dict) -> dict:
        line = {}
        for key, value in values.items():
            if value is None:
                continue
            if key == "body" and value.__class__ is str:   # the body as JSON text, parsed as a line's would be
                try:
                    value = parse_json(value, self._max_depth - 1)
                except Bad as e:
                    raise Bad(f"body: {e}") from None
            else:
                value = self._convert[key](value, key)
            line[key] = value
        return line

    def _batch_rows(self) -> int:
        """Rows a batch holds: about BATCH_BYTES of the largest rows' (on average over a row group)."""
        meta = self._file.metadata
        widest = max((meta.row_group(i).total_byte_size / max(1, meta.row_group(i).num_rows)
                      for i in range(meta.num_row_groups)), default=1.0)
        return max(1, min(MAX_BATCH_ROWS, int(BATCH_BYTES / max(1.0, widest))))


def line_columns(schema: pa.Schema, columns: TableColumns, our_fields) -> dict[str, str]:
    """{line field: column} of a table, or Bad naming what is missing or mistyped, and every column."""
    names = schema.names

    def refuse(problem: str) -> Bad:
        listed = ", ".join(f"{f.name}: {f.type}" for f in schema)
        return Bad(f"{problem}; the file's columns are {listed or 'none'}")

    def check(name: str, option: str | None, kinds: tuple, what: str) -> None:
        called = f"{option} {name!r}" if option else f"the column {name!r}"
        if name not in names:
            raise refuse(f"{called} is not a column of the file")
        if not any(kind(schema.field(name).type) for kind in kinds):
            raise refuse(f"{called} is {schema.field(name).type}, not {what}")

    if columns == TableColumns() and {"custom_id", "body"} & set(names):
        missing = [c for c in OPENAI_COLUMNS if c not in names]
        if missing:
            raise refuse(f"an OpenAI batch table has the columns custom_id, method, url and body; this one has no "
                         f"{', '.join(missing)}")
        check("body", None, (_text, pa.types.is_struct), "a JSON string or a struct")
        return {c: c for c in OPENAI_COLUMNS}
    found: dict[str, str] = {}
    for key, option, given in (("prompt", "--prompt-column", columns.prompt_column),
                               ("id", "--id-column", columns.id_column)):
        name = given if given is not None else key if key in names else None
        if name is not None:
            check(name, option if given is not None else None, (_text,), "a string column")
            found[key] = name
    if "messages" in names and found.get("prompt") != "messages":
        check("messages", None, (_list_of_messages,), "a list of {role, content} structs")
        found["messages"] = "messages"
    if not found.keys() & {"prompt", "messages"} and not ("input" in names and "input" in our_fields):
        raise refuse("the table has no prompt: name its prompt column with --prompt-column (a string column), or "
                     "give a messages column (a list of {role, content} structs), an input column (to embed), or "
                     "the OpenAI batch columns custom_id, method, url and body")
    taken = set(found.values())
    found.update({name: name for name in names if name in our_fields and name not in found and name not in taken})
    return found


def _text(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _is_list(t: pa.DataType) -> bool:
    return (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
            or pa.types.is_list_view(t) or pa.types.is_large_list_view(t))


def _list_of_messages(t: pa.DataType) -> bool:
    return _is_list(t) and pa.types.is_struct(t.value_type) and t.value_type.get_field_index("role") >= 0


def _depth(t: pa.DataType) -> int:
    """The JSON nesting a value of type t adds (a list or an object: one level)."""
    if pa.types.is_dictionary(t):
        return _depth(t.value_type)
    if pa.types.is_struct(t):
        return 1 + max((_depth(f.type) for f in t), default=0)
    if pa.types.is_map(t):
        return 1 + _depth(t.item_type)
    if _is_list(t):
        return 1 + _depth(t.value_type)
    return 0


def _converter(t: pa.DataType) -> _Convert:
    """How a non-null value of Arrow type t, as to_pylist gives it, becomes the JSON value a line
    would hold: a struct an object without its nulls, a map an object, a list a list."""
    if pa.types.is_dictionary(t):
        return _converter(t.value_type)
    if pa.types.is_struct(t):
        fields = [(f.name, _converter(f.type)) for f in t]
        return lambda v, where: {name: convert(v[name], f"{where}.{name}") for name, convert in fields
                                 if v[name] is not None}
    if pa.types.is_map(t):
        return _map_converter(t)
    if _is_list(t):
        item = _converter(t.value_type)
        return lambda v, where: [x if x is None else item(x, f"{where}[{i}]") for i, x in enumerate(v)]
    if _text(t) or pa.types.is_boolean(t) or pa.types.is_integer(t) or pa.types.is_null(t):
        return lambda v, where: v
    if pa.types.is_floating(t):
        return _finite
    return lambda v, where: _refuse(t, where)


def _map_converter(t: pa.DataType) -> _Convert:
    item = _converter(t.item_type)
    if not (_text(t.key_type) or pa.types.is_integer(t.key_type)):
        return lambda v, where: _refuse(t, where)

    def convert(pairs, where):
        obj = {}
        for key, value in pairs:
            key = str(key)   # a JSON object's keys are text (logit_bias's token ids too)
            if key in obj:
                raise Bad(f"{where} has the key {key!r} twice")
            obj[key] = value if value is None else item(value, f"{where}.{key}")
        return obj
    return convert


def _finite(v, where: str) -> float:
    if math.isfinite(v):
        return float(v)
    raise Bad(f"{where} is {v}: NaN and infinities are not JSON numbers (numbers must be finite)")


def _refuse(t: pa.DataType, where: str):
    raise Bad(f"{where} is a {t} value, which a JSON line cannot hold (give it as a string or a number)")
