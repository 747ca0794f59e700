"""Scanning a whole input file in line ranges (jobs.input.file_scan) finds exactly what one pass
finds, and writes the same shards; ids are checked across ranges (jobs.input.unique_ids)."""
from __future__ import annotations

import json

import pytest

from jobs.input import file_scan, unique_ids
from jobs.input.file_scan import validate, write_input_shards
from jobs.paths import input_shard_name
from jobs.input.shard_files import read_shard
from jobs.input.line_checks import InvalidInput, Limits, validate as validate_in_one_pass
from jobs.input.unique_ids import IdLog, duplicates

CHAT = "/v1/chat/completions"


def write(tmp_path, lines, name="input.jsonl") -> str:
    path = tmp_path / name
    path.write_bytes(b"".join((json.dumps(line).encode() if isinstance(line, dict) else line.encode()) + b"\n"
                              for line in lines))
    return str(path)


def generation_lines(n: int) -> list:
    """Lines of many shapes: with and without ids, chat and prompt, sampling settings, blank lines."""
    lines = []
    for i in range(n):
        if i % 7 == 3:
            lines.append("")                                   # blank lines keep their numbers
        elif i % 5 == 0:
            lines.append({"prompt": f"p{i}", "max_tokens": 1 + i % 9})   # a default id: line-NNNNNN
        elif i % 5 == 1:
            lines.append({"id": f"c{i}", "messages": [{"role": "user", "content": f"m{i}"}], "temperature": 0,
                          "seed": i})
        else:
            lines.append({"id": f"r{i}", "prompt": f"q{i}", "top_p": 0.5, "stop": ["\n"], "logprobs": 2})
    return lines


def outcome(v):
    return v.num_requests, v.num_errors, [(e.line, e.message) for e in v.errors], v.input_format, v.endpoint


def shard_lines(directory, sizes):
    return [spec for index in range(len(sizes)) for spec in read_shard(directory / input_shard_name(index))]


@pytest.mark.parametrize("ranges", [2, 3, 5])
def test_a_valid_file_in_ranges_gives_the_one_pass_outcome_and_the_same_requests(tmp_path, ranges):
    path = write(tmp_path, generation_lines(120))
    one, sizes_one = write_input_shards(path, tmp_path / "one", 8, ranges=1)
    many, sizes_many = write_input_shards(path, tmp_path / "many", 8, ranges=ranges)
    assert outcome(many) == outcome(one) == outcome(validate_in_one_pass(path)) and one.ok
    assert sum(sizes_many) == sum(sizes_one) == one.num_requests
    assert len(sizes_many) > len(sizes_one)                      # each range ends with a shard of its own
    assert shard_lines(tmp_path / "many", sizes_many) == shard_lines(tmp_path / "one", sizes_one)
    assert [s.line for s in shard_lines(tmp_path / "many", sizes_many)] == sorted(
        s.line for s in shard_lines(tmp_path / "one", sizes_one))
    assert not list(tmp_path.glob(".*partial"))


def test_errors_and_ids_used_twice_across_ranges_are_found_as_one_pass_finds_them(tmp_path):
    lines = generation_lines(90)
    lines[40] = {"id": "r2", "prompt": "the id of line 3"}                     # a duplicate in another range
    lines[60] = {"id": "r2", "prompt": "again", "temperature": 9}              # a duplicate with its own problem
    lines[70] = "{not json"
    lines[85] = {"custom_id": "x", "method": "POST", "url": CHAT, "body": {}}  # another format, late in the file
    lines[88] = {"prompt": "the default id of line 6", "id": "line-000006"}     # an id like a default one
    path = write(tmp_path, lines)
    one = validate_in_one_pass(path)
    for ranges in (2, 4):
        many = validate(path, ranges=ranges)
        assert outcome(many) == outcome(one)
    errors = {e.line: e.message for e in one.errors}
    assert errors[41] == "duplicate id 'r2' (first on line 3)"
    assert errors[61].startswith("temperature must be") and errors[61].endswith("; duplicate id 'r2' (first on line 3)")
    assert errors[89] == "duplicate id 'line-000006' (first on line 6)"
    assert "one format throughout" in errors[86] and "invalid JSON" in errors[71]
    with pytest.raises(InvalidInput):
        write_input_shards(path, tmp_path / "s", 10, ranges=3)
    assert not (tmp_path / "s").exists() and not list(tmp_path.glob(".*partial"))


def test_the_kept_errors_are_the_first_ones_by_line_whatever_the_ranges(tmp_path):
    lines = [{"id": f"d{i % 10}", "prompt": "x"} if i % 3 else "[]" for i in range(200)]
    path = write(tmp_path, lines)
    limits = Limits(max_errors_kept=25)
    one = validate_in_one_pass(path, limits)
    assert one.num_errors == 200 - 10 and len(one.errors) == 25
    assert outcome(validate(path, limits, ranges=4)) == outcome(one)


def test_an_embedding_file_and_a_start_that_settles_nothing(tmp_path):
    emb = write(tmp_path, [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
                            "body": {"input": [f"t{i}", "u"]}} for i in range(40)], "e.jsonl")
    assert outcome(validate(emb, ranges=3)) == outcome(validate_in_one_pass(emb))
    assert validate(emb, ranges=3).endpoint == "/v1/embeddings"
    # The format is learned from the first JSON object: a file whose first range has none is read in one pass.
    odd = write(tmp_path, ["{bad"] * 30 + [{"prompt": "a"}] * 3, "odd.jsonl")
    assert outcome(validate(odd, ranges=3)) == outcome(validate_in_one_pass(odd))


def test_more_lines_than_the_request_limit_is_judged_in_one_pass(tmp_path):
    path = write(tmp_path, [{"prompt": f"{i}"} for i in range(30)])
    limits = Limits(max_requests=20)
    assert file_scan._plan(path, limits, None, 3)[0] == [(0, None, 1)]
    assert outcome(validate(path, limits, ranges=3)) == outcome(validate_in_one_pass(path, limits))
    assert "more than 20 requests" in validate(path, limits, ranges=3).errors[0].message


def test_ranges_start_at_line_starts_with_their_line_numbers(tmp_path):
    path = write(tmp_path, [{"prompt": "x" * (i % 13)} for i in range(50)])
    spans, seed = file_scan._plan(path, Limits(), None, 4)
    data = open(path, "rb").read()
    assert len(spans) == 4 and spans[0][:1] == (0,) and spans[-1][1] is None and seed.input_format == "pipeline"
    for start, end, first_line in spans:
        assert start == 0 or data[start - 1:start] == b"\n"
        assert first_line == data[:start].count(b"\n") + 1


def test_equal_digests_of_different_ids_are_not_duplicates(monkeypatch):
    """Digests only point at candidates: the ids read again decide."""
    monkeypatch.setattr(unique_ids, "digest", lambda rid: len(rid))   # every id of one length collides
    ids = {1: "ab", 2: "cd", 3: "ab", 4: "xyz", 5: "cd", 6: "ef", 7: "ab"}
    log = IdLog()
    for line, rid in ids.items():
        log.add(rid, line)
    asked = []
    found = duplicates(log, lambda lines: asked.append(sorted(lines)) or {line: ids[line] for line in lines})
    assert found == {3: ("ab", 1), 5: ("cd", 2), 7: ("ab", 1)}
    assert asked == [[1, 2, 3, 5, 6, 7]]                             # "xyz" met no other digest: never read
    whole = IdLog(*log.state())
    whole.extend(IdLog())
    assert duplicates(whole, lambda lines: {line: ids[line] for line in lines}) == found


def test_a_shard_line_as_written_is_its_requests_dict_so_both_give_one_key(tmp_path):
    """The submit keys a rerun's lines straight from the shard file (jobs.reuse.stored_answers) and
    so does a worker (workers.shard_runner): a line as written must be its RequestSpec's to_dict(),
    for every shape of line, so that the key is the request's whoever reads it."""
    from jobs.reuse.answer_key import request_key
    from jobs.input.request_spec import RequestSpec

    chat = [{"custom_id": f"o{i}", "method": "POST", "url": CHAT,
             "body": {"model": "m", "messages": [{"role": "user", "content": f"hi {i}"}], "temperature": 0,
                      "n": 1 + i % 2, "logprobs": True, "top_logprobs": 2, "frequency_penalty": 0.5,
                      "seed": i, "stop": "x", **({"response_format": {"type": "json_object"}} if i % 2 else {
                          "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                          "tool_choice": {"type": "function", "function": {"name": "f"}}})}} for i in range(6)]
    chat.append({"custom_id": "e", "method": "POST", "url": CHAT, "body": {"model": "m", "messages": [
        {"role": "user", "content": "x"}], "logit_bias": {"12": 5}, "max_completion_tokens": 3}})
    embeddings = [{"custom_id": f"v{i}", "method": "POST", "url": "/v1/embeddings",
                   "body": {"model": "m", "input": ["a", f"b{i}"] if i % 2 else f"c{i}",
                            **({"dimensions": 8, "encoding_format": "base64"} if i % 3 else {})}} for i in range(6)]
    for name, lines in (("ours", generation_lines(60)), ("openai", chat), ("embeddings", embeddings)):
        path = write(tmp_path, lines, f"{name}.jsonl")
        _, sizes = write_input_shards(path, tmp_path / name, 7, model="m")
        for index in range(len(sizes)):
            raw = [json.loads(line) for line in (tmp_path / name / input_shard_name(index)).read_text().splitlines()]
            for line in raw:
                spec = RequestSpec.from_dict(dict(line))
                assert spec.to_dict() == line
                assert request_key(line, "e" * 32) == request_key(spec.to_dict(), "e" * 32)
