"""A Parquet table as input (jobs.input.parquet_lines): each row becomes exactly the shard line
its JSONL line would, so every check applies unchanged; errors say "row N"; a column an option
names that is missing or mistyped is one error listing the columns; the table is read a batch
of rows at a time, never whole."""
from __future__ import annotations

import json
import os
import tracemalloc

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.input import parquet_lines
from jobs.input.file_scan import validate, write_input_shards
from jobs.input.line_checks import InvalidInput, iter_lines
from jobs.input.parquet_lines import TableRows
from jobs.input.request_source import TableColumns
from jobs.paths import input_shard_name

CHAT = "/v1/chat/completions"
ALL_FIELDS = {"id", "prompt", "messages", "max_tokens", "temperature", "stop", "seed", "logit_bias"}


def table_file(tmp_path, columns: dict | pa.Table, name="in.parquet", **write) -> str:
    path = tmp_path / name
    pq.write_table(columns if isinstance(columns, pa.Table) else pa.table(columns), path, **write)
    return str(path)


def jsonl_file(tmp_path, lines: list[dict], name="in.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def shards(tmp_path, path, name, **options) -> bytes:
    """The shard files' bytes that submitting `path` writes (one shard of up to 1000 lines)."""
    _, sizes = write_input_shards(path, tmp_path / name, 1000, **options)
    return b"".join((tmp_path / name / input_shard_name(i)).read_bytes() for i in range(len(sizes)))


def errors(path, **options) -> dict:
    v = validate(path, **options)
    return {e.line: str(e) for e in v.errors}


def file_error(path, **options) -> str:
    v = validate(path, **options)
    assert v.num_errors == 1 and v.errors[0].line is None, v.errors
    return v.errors[0].message


# --- each shape makes the shard lines its JSONL lines make -----------------------------------

def test_a_prompt_column_named_by_option_with_an_id_column_and_settings_columns(tmp_path):
    path = table_file(tmp_path, {"key": ["a", "b", "c"], "question": ["Once upon", "a time", "there was"],
                                 "max_tokens": [4, None, 8], "temperature": [0.0, 0.7, None],
                                 "stop": [["\n"], None, ["x", "y"]], "notes": ["not read", "", "at all"]})
    lines = [{"id": "a", "prompt": "Once upon", "max_tokens": 4, "temperature": 0.0, "stop": ["\n"]},
             {"id": "b", "prompt": "a time", "temperature": 0.7},
             {"id": "c", "prompt": "there was", "max_tokens": 8, "stop": ["x", "y"]}]
    columns = TableColumns(id_column="key", prompt_column="question")
    assert shards(tmp_path, path, "table", columns=columns) == shards(tmp_path, jsonl_file(tmp_path, lines), "jsonl")
    specs = [item for _, item in iter_lines(path, columns=columns)]
    assert [(s.id, s.line, s.max_tokens, s.temperature) for s in specs] == [
        ("a", 1, 4, 0.0), ("b", 2, 256, 0.7), ("c", 3, 8, 1.0)]


def test_default_prompt_and_id_columns_and_the_default_id_of_a_row(tmp_path):
    path = table_file(tmp_path, {"id": ["x", None], "prompt": ["Hi", "Ho"]})
    assert [(s.id, s.line) for _, s in iter_lines(path)] == [("x", 1), ("row-000002", 2)]


def test_a_messages_column_of_structs(tmp_path):
    messages = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}],
                [{"role": "user", "content": "Hi"}]]
    path = table_file(tmp_path, {"id": ["m1", "m2"], "messages": messages, "seed": [1, None]})
    lines = [{"id": "m1", "messages": messages[0], "seed": 1}, {"id": "m2", "messages": messages[1]}]
    assert shards(tmp_path, path, "table") == shards(tmp_path, jsonl_file(tmp_path, lines), "jsonl")


def openai_lines():
    bodies = [{"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 5,
               "temperature": 0.0},
              {"model": "m", "messages": [{"role": "system", "content": "Terse."}, {"role": "user", "content": "Yo"}],
               "logit_bias": {"42": -100}}]
    return [{"custom_id": f"c{i}", "method": "POST", "url": CHAT, "body": body} for i, body in enumerate(bodies)]


@pytest.mark.parametrize("body_as", ["string", "struct"])
def test_the_openai_batch_columns_with_the_body_as_a_json_string_or_a_struct(tmp_path, body_as):
    lines = openai_lines()
    columns = {name: [line[name] for line in lines] for name in ("custom_id", "method", "url")}
    if body_as == "string":
        columns["body"] = [json.dumps(line["body"]) for line in lines]
        table = pa.table(columns)
    else:   # a struct: fields absent from a row are null there; logit_bias a map, as a table keeps one
        bias = pa.map_(pa.string(), pa.float64())
        body = pa.struct([("model", pa.string()), ("messages", pa.list_(pa.struct([("role", pa.string()),
                                                                                   ("content", pa.string())]))),
                          ("max_completion_tokens", pa.int64()), ("temperature", pa.float64()), ("logit_bias", bias)])
        columns["body"] = pa.array([line["body"] for line in lines], type=body)
        table = pa.table(columns)
    path = table_file(tmp_path, table)
    assert validate(path).input_format == "openai" and validate(path).endpoint == CHAT
    assert shards(tmp_path, path, "table") == shards(tmp_path, jsonl_file(tmp_path, lines), "jsonl")


def test_an_input_column_to_embed(tmp_path):
    path = table_file(tmp_path, {"id": ["d1", "d2"], "input": [["one text", "two"], ["three"]],
                                 "dimensions": [8, None]})
    lines = [{"id": "d1", "input": ["one text", "two"], "dimensions": 8}, {"id": "d2", "input": ["three"]}]
    assert shards(tmp_path, path, "table") == shards(tmp_path, jsonl_file(tmp_path, lines), "jsonl")


def test_a_table_is_found_by_its_first_bytes_whatever_its_name(tmp_path):
    path = table_file(tmp_path, {"prompt": ["Hi"]}, name="upload.jsonl")   # as `pipeline serve` keeps uploads
    assert [s.prompt for _, s in iter_lines(path)] == ["Hi"]


# --- errors: by row, and one for the file ----------------------------------------------------

def test_bad_rows_are_reported_by_row_number_as_their_lines_would_be(tmp_path):
    path = table_file(tmp_path, {
        "id": ["a", "b", "a", "c", "d", "e"],
        "prompt": ["fine", None, "again", "fine", "fine", "fine"],
        "temperature": [0.0, 0.0, 0.0, 9.0, float("nan"), 0.0],
        "max_tokens": [1, 1, 1, 1, 1, 0]})
    assert errors(path) == {
        2: "row 2: missing prompt or messages (give exactly one)",
        3: "row 3: duplicate id 'a' (first on row 1)",
        4: "row 4: temperature must be a number between 0 and 2, got 9.0",
        5: "row 5: temperature is nan: NaN and infinities are not JSON numbers (numbers must be finite)",
        6: "row 6: max_tokens must be between 1 and 1000000, got 0"}
    with pytest.raises(InvalidInput) as e:
        write_input_shards(path, tmp_path / "s", 10)
    assert "5 error(s)" in str(e.value) and "row 2:" in str(e.value) and not (tmp_path / "s").exists()


def test_bad_openai_rows_name_their_rows(tmp_path):
    path = table_file(tmp_path, {
        "custom_id": ["a", "b", "c", None],
        "method": ["POST", "GET", "POST", "POST"],
        "url": [CHAT, CHAT, "/v1/completions", CHAT],
        "body": ['{"messages": [{"role": "user", "content": "Hi"}]}',
                 '{"messages": [{"role": "user", "content": "x"}]}',
                 '{"prompt": "x"}',
                 '{"messages": [{"role": "user", "content": "Hi"}], "n": 1,}']})   # a stray comma: not JSON
    found = errors(path)
    assert found[2] == 'row 2: method must be "POST", got \'GET\''
    assert found[3].startswith(f"row 3: url '/v1/completions' differs from '{CHAT}' of row 1; every line of a "
                               "batch must use the same url")
    assert found[4].startswith("row 4: body: invalid JSON:") and 1 not in found


def test_values_a_json_line_cannot_hold_are_row_errors(tmp_path):
    import datetime
    path = table_file(tmp_path, {"prompt": ["a", "b"], "seed": [1, None],
                                 "logit_bias": pa.array([None, datetime.datetime(2026, 1, 1)])})
    assert errors(path) == {2: "row 2: logit_bias is a timestamp[us] value, which a JSON line cannot hold (give it "
                               "as a string or a number)"}


def test_a_missing_or_mistyped_column_is_one_error_listing_the_columns(tmp_path):
    path = table_file(tmp_path, {"key": [1, 2], "text": ["a", "b"]})
    listing = "the file's columns are key: int64, text: string"
    assert file_error(path, columns=TableColumns(prompt_column="question")) == \
        f"--prompt-column 'question' is not a column of the file; {listing}"
    assert file_error(path, columns=TableColumns(id_column="key", prompt_column="text")) == \
        f"--id-column 'key' is int64, not a string column; {listing}"
    assert file_error(path).startswith("the table has no prompt: name its prompt column with --prompt-column")
    assert file_error(path).endswith(listing)
    openai = table_file(tmp_path, {"custom_id": ["a"], "body": ["{}"]}, name="openai.parquet")
    assert file_error(openai).startswith("an OpenAI batch table has the columns custom_id, method, url and body; "
                                         "this one has no method, url;")
    jsonl = jsonl_file(tmp_path, [{"prompt": "x"}])
    assert file_error(jsonl, columns=TableColumns(prompt_column="text")) == \
        f"--prompt-column name a Parquet table's columns; {jsonl} is JSON lines, whose lines name their own fields"
    not_parquet = tmp_path / "broken.parquet"
    not_parquet.write_bytes(b"PAR1 and then nothing")
    assert file_error(str(not_parquet)).startswith("the input is not a readable Parquet file")
    empty = table_file(tmp_path, pa.table({"prompt": pa.array([], pa.string())}), name="empty.parquet")
    assert file_error(empty) == "the table has no rows"


def test_nulls_are_fields_left_out_at_the_top_and_inside_structs(tmp_path):
    message = pa.struct([("role", pa.string()), ("content", pa.string()), ("name", pa.string())])
    path = table_file(tmp_path, pa.table({
        "id": ["a", "b", "c"],
        "prompt": pa.array([None, "plain", None], pa.string()),
        "messages": pa.array([[{"role": "user", "content": "Hi", "name": None}], None,
                              [{"role": "user", "content": "Hi", "name": "ann"}]], pa.list_(message)),
        "max_tokens": [None, 3, None]}))
    specs = [s for _, s in iter_lines(path)]
    assert [(s.prompt, s.messages, s.max_tokens) for s in specs] == [
        (None, [{"role": "user", "content": "Hi"}], 256), ("plain", None, 3),
        (None, [{"role": "user", "content": "Hi", "name": "ann"}], 256)]


# --- streamed: a batch of rows at a time -----------------------------------------------------

def test_a_table_of_many_row_groups_is_read_in_order_with_its_row_numbers(tmp_path):
    n = 5000
    path = table_file(tmp_path, {"id": [f"r{i}" for i in range(n)], "prompt": [f"p{i}" for i in range(n)]},
                      row_group_size=700)
    assert pq.ParquetFile(path).metadata.num_row_groups == 8
    _, sizes = write_input_shards(path, tmp_path / "s", 256)
    assert sum(sizes) == n and len(sizes) == 20
    lines = [json.loads(line) for i in range(len(sizes)) for line in (tmp_path / "s" / input_shard_name(i)).open()]
    assert [(line["id"], line["line"], line["prompt"]) for line in lines] == [
        (f"r{i}", i + 1, f"p{i}") for i in range(n)]


def test_a_large_row_group_is_never_held_whole(tmp_path, monkeypatch):
    """One row group of about 64 MB of text, read with batches of about 1 MiB: the Python
    objects and Arrow buffers alive at once stay near a batch and the read buffer."""
    monkeypatch.setattr(parquet_lines, "BATCH_BYTES", 1 << 20)
    rows = 16_000
    prompts = [os.urandom(2000).hex() for _ in range(rows)]   # 4,000 characters that hardly compress
    path = table_file(tmp_path, {"prompt": prompts}, row_group_size=rows)
    del prompts
    assert pq.ParquetFile(path).metadata.num_row_groups == 1
    table = TableRows(open(path, "rb"), None, ALL_FIELDS, 32)
    arrow_peak, count = 0, 0
    tracemalloc.start()
    try:
        for number, obj in table:
            count += 1
            if number % 250 == 1:
                arrow_peak = max(arrow_peak, pa.total_allocated_bytes())
        python_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    batches = -(-rows // table._batch_rows())
    assert count == rows and batches >= 50
    assert python_peak < 8 << 20, python_peak      # the 64 MB of text: a batch's strings and the 1 MiB read buffer
    assert arrow_peak < 16 << 20, arrow_peak
