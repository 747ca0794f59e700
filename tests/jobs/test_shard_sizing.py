"""`--shard-size auto` (jobs.input.shard_sizing): a job's shards hold about the same work, so
that a large job's 1-token and embedding lines come in larger shards than long generations,
while a small job keeps enough shards to spread over many workers; a given size is kept; a
job made with it is sharded, recorded and validated as one of a fixed size."""
from __future__ import annotations

import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from input_files import CHAT, batch_line, write
from jobs.input import shard_sizing
from jobs.input.shard_sizing import (AUTO, AUTO_SHARD_TOKENS, DEFAULT_MAX_TOKENS, MAX_LINES, MIN_LINES, MIN_SHARDS,
                                     line_weight, resolve_shard_size)
from jobs.input.validation import InvalidInput
from jobs.ledger import get_job
from jobs.paths import JobPaths
from jobs.submission import create_job_from_file

REVIEW = "the food arrived warm but the bill was wrong twice"


def classify(i: int) -> dict:
    review = f"{REVIEW}, and the manager never called back ({i})"
    return {"id": f"c{i}", "messages": [{"role": "user", "content": f"Positive or negative? {review}"}],
            "max_tokens": 1, "temperature": 0}


def write_many(tmp_path, line: bytes, n: int) -> str:
    path = tmp_path / "many.jsonl"
    path.write_bytes((line + b"\n") * n)
    return str(path)


def test_a_lines_weight_is_what_it_sends_the_model_and_its_output_tokens_roughly():
    short = classify(0)
    assert 20 < line_weight(short) < 50   # some 140 bytes of messages, 1 output token
    assert line_weight({**short, "max_tokens": None}) == line_weight(short) - 1 + DEFAULT_MAX_TOKENS
    assert line_weight({**short, "n": 4, "max_tokens": 10}) == line_weight(short) - 1 + 40
    assert line_weight({**short, "max_tokens": "many"}) == line_weight(short) - 1 + DEFAULT_MAX_TOKENS   # the default
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        f"field{i}": {"type": "string", "description": "a long description " * 4} for i in range(10)}}}}
    assert line_weight({**short, "tools": [tool]}) > line_weight(short) + 200   # tools are sent too
    prompts = {"prompt": ["a", "b", "c"], "max_tokens": 1}
    assert line_weight({**prompts, "max_tokens": 5}) == line_weight(prompts) + 12   # 4 tokens more for each prompt
    assert line_weight({"input": REVIEW}) == 1 + len(json.dumps(REVIEW)) // 4   # an embedding: no output
    assert line_weight({"input": [[1, 2, 3] * 100]}) > 100   # token ids: about one a token
    openai = batch_line("o", {"model": "m", "messages": short["messages"], "max_completion_tokens": 1})
    assert line_weight(openai) == line_weight(short)
    assert line_weight(batch_line("e", {"model": "m", "input": REVIEW}, url="/v1/embeddings")) == \
        line_weight({"input": REVIEW})
    essay = batch_line("r", {"model": "m", "input": "Write an essay", "max_output_tokens": 4096}, url="/v1/responses")
    assert line_weight(essay) > 4096   # a Responses line's input is its prompt, not an embedding's
    schema = {"type": "object", "properties": {f"f{i}": {"type": "string"} for i in range(20)}}
    assert line_weight({**short, "structured_outputs": {"json": schema}}) > line_weight(short) + 100
    assert line_weight({"prompt": "x", "max_tokens": 10 ** 400, "n": 10 ** 200}) < 10 ** 9   # bounded, as validated
    assert line_weight([1, 2]) is None and line_weight("text") is None


def test_a_large_job_gets_shards_by_its_lines_work(tmp_path):
    embeddings = write_many(tmp_path, json.dumps({"id": "e", "input": REVIEW}).encode(), MIN_SHARDS * MAX_LINES + 1)
    assert resolve_shard_size(AUTO, embeddings) == MAX_LINES
    classification = write_many(tmp_path, json.dumps(classify(0)).encode(), MIN_SHARDS * MAX_LINES)
    assert MIN_LINES < resolve_shard_size(AUTO, classification) == int(AUTO_SHARD_TOKENS / line_weight(
        classify(0))) < MAX_LINES
    generations = write_many(tmp_path, json.dumps({"id": "g", "prompt": REVIEW}).encode(), MIN_SHARDS * MAX_LINES)
    assert resolve_shard_size(AUTO, generations) == MIN_LINES   # 256 output tokens each: the floor
    assert resolve_shard_size(300, generations) == 300   # a size given is kept


@pytest.mark.parametrize("lines", [3000, 40_000])
def test_a_smaller_job_keeps_enough_shards_to_spread_over_workers(tmp_path, lines):
    path = write_many(tmp_path, json.dumps({"id": "e", "input": REVIEW}).encode(), lines)
    assert resolve_shard_size(AUTO, path) == max(MIN_LINES, math.ceil(lines / MIN_SHARDS))


def test_a_line_validation_refuses_never_stops_the_sizing(tmp_path):
    huge = '{"id": "a", "prompt": "x", "max_tokens": ' + "9" * 400 + ', "n": ' + "9" * 300 + "}"
    assert resolve_shard_size(AUTO, write(tmp_path, [huge])) == MIN_LINES   # validation then says why


def test_a_file_that_says_nothing_gets_the_floor(tmp_path):
    assert resolve_shard_size(AUTO, write(tmp_path, ["not json", "", "[1, 2]", "[" * 2000 + "]" * 2000])) == MIN_LINES
    assert resolve_shard_size(AUTO, tmp_path / "missing.jsonl") == MIN_LINES
    table = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["a"], "input": [REVIEW]}), table)
    assert resolve_shard_size(AUTO, table) == MIN_LINES
    with pytest.raises(ValueError, match="auto"):
        resolve_shard_size("512", table)


def test_a_job_made_with_auto_is_sharded_and_recorded_at_that_size(tmp_path, data_root, Session, monkeypatch):
    monkeypatch.setattr(shard_sizing, "MIN_SHARDS", 1)   # a job this small would keep 64 shards' spread
    path = write(tmp_path, [{"id": f"e{i}", "input": f"{REVIEW} {i}"} for i in range(MAX_LINES + 10)])
    job_id, sizes = create_job_from_file(Session, data_root, path, model="m", engine_options={}, shard_size=AUTO)
    assert sizes == [MAX_LINES, 10]
    with Session() as s:
        assert get_job(s, job_id).shard_size == MAX_LINES   # what a retry of it reuses
    assert len(list(JobPaths(data_root, job_id).input_dir.iterdir())) == 2
    bad = write(tmp_path, [{"id": "a", "input": REVIEW}, {"id": "b", "input": REVIEW, "dimensions": -1}], "bad.jsonl")
    with pytest.raises(InvalidInput, match="line 2"):   # validated as with a fixed size
        create_job_from_file(Session, data_root, bad, model="m", engine_options={}, shard_size=AUTO)


def test_chat_lines_in_the_openai_format_are_read_as_their_bodies(tmp_path):
    openai = [batch_line(f"o{i}", {"model": "m", "messages": classify(i)["messages"], "max_tokens": 1}, url=CHAT)
              for i in range(20)]
    assert [line_weight(line) for line in openai] == [line_weight(classify(i)) for i in range(20)]
