"""Job input validation and sharding (jobs.input.line_checks), on real files."""
from __future__ import annotations

import json
import os
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobs.paths import input_shard_name as shard_file_name
from jobs.input.file_scan import write_input_shards as write_shards
from jobs.input.shard_files import read_shard
from jobs.input.line_checks import InvalidInput, LineError, Limits, RequestSpec, iter_lines, validate

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def write(tmp_path, lines, name="input.jsonl") -> str:
    """Write lines (dicts become JSON, str/bytes are written as they are) one a line."""
    path = tmp_path / name
    with open(path, "wb") as f:
        for line in lines:
            if isinstance(line, dict):
                line = json.dumps(line)
            f.write((line.encode() if isinstance(line, str) else line) + b"\n")
    return str(path)


def batch_line(custom_id, body, url=CHAT, method="POST") -> dict:
    return {"custom_id": custom_id, "method": method, "url": url, "body": body}


def chat_body(**extra) -> dict:
    return {"model": "gpt-x", "messages": [{"role": "user", "content": "hi"}], **extra}


def errors_by_line(path, limits=Limits()) -> dict[int | None, str]:
    v = validate(path, limits)
    assert v.num_errors == len(v.errors)
    return {e.line: e.message for e in v.errors}


def specs(path, limits=Limits()) -> list[RequestSpec]:
    items = [item for _, item in iter_lines(path, limits)]
    assert all(isinstance(i, RequestSpec) for i in items), items
    return items


# --- good files ---------------------------------------------------------------------------

def test_pipeline_format_ids_and_defaults(tmp_path):
    path = write(tmp_path, [
        {"prompt": "Once upon a time"},
        {"id": "chat-1", "messages": [{"role": "system", "content": "be brief"},
                                      {"role": "user", "content": "hi"}],
         "max_tokens": 7, "temperature": 0, "top_p": 0.5, "top_k": 40, "min_p": 0.1,
         "repetition_penalty": 1.2, "seed": -5, "stop": "\n", "ignore_eos": True},
        {"prompt": "x", "stop": ["a", "b"], "seed": None, "temperature": None},
    ])
    first, second, third = specs(path)
    assert first == RequestSpec(id="line-000001", line=1, prompt="Once upon a time", messages=None,
                                max_tokens=256, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0,
                                repetition_penalty=1.0, seed=None, stop=[], ignore_eos=False)
    assert second.id == "chat-1" and second.prompt is None
    assert second.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert (second.max_tokens, second.temperature, second.top_p, second.top_k, second.min_p,
            second.repetition_penalty, second.seed, second.stop, second.ignore_eos) == \
        (7, 0.0, 0.5, 40, 0.1, 1.2, -5, ["\n"], True)
    assert isinstance(second.temperature, float)
    assert (third.id, third.stop, third.seed, third.temperature) == ("line-000003", ["a", "b"], None, 1.0)
    v = validate(path)
    assert (v.ok, v.num_requests, v.input_format, v.endpoint) == (True, 3, "pipeline", None)


def test_openai_chat_mapping(tmp_path):
    path = write(tmp_path, [
        batch_line("r1", chat_body(max_completion_tokens=12, temperature=0.3, top_p=0.9, seed=7,
                                   stop=["END"], n=1, top_k=5, min_p=0.05, repetition_penalty=1.1,
                                   ignore_eos=True)),
        batch_line("r2", {"messages": [{"role": "user", "content": "yo"}], "max_tokens": 3, "stop": "x"}),
    ])
    r1, r2 = specs(path)
    assert r1 == RequestSpec(id="r1", line=1, prompt=None, messages=[{"role": "user", "content": "hi"}],
                             max_tokens=12, temperature=0.3, top_p=0.9, top_k=5, min_p=0.05,
                             repetition_penalty=1.1, seed=7, stop=["END"], ignore_eos=True, model="gpt-x")
    assert (r2.id, r2.max_tokens, r2.stop, r2.model, r2.temperature) == ("r2", 3, ["x"], None, 1.0)
    v = validate(path)
    assert (v.ok, v.num_requests, v.input_format, v.endpoint) == (True, 2, "openai", CHAT)


def test_openai_completions_mapping(tmp_path):
    path = write(tmp_path, [batch_line("c1", {"model": "m", "prompt": "Say", "max_tokens": 4}, url=COMPLETIONS)])
    (c1,) = specs(path)
    assert (c1.id, c1.prompt, c1.messages, c1.max_tokens, c1.model) == ("c1", "Say", None, 4, "m")
    assert validate(path).endpoint == COMPLETIONS


def test_blank_lines_are_skipped_and_numbering_kept(tmp_path):
    path = write(tmp_path, ["", {"prompt": "a"}, "   ", "\t\r", {"prompt": "b"}, ""])
    assert [(s.id, s.line) for s in specs(path)] == [("line-000002", 2), ("line-000005", 5)]


def test_utf8_bom_and_crlf_are_accepted(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "caf\xc3\xa9"}\r\n{"prompt": "b"}\r\n')
    assert [s.prompt for s in specs(str(path))] == ["café", "b"]


# --- bad lines ----------------------------------------------------------------------------

def test_every_bad_line_is_reported_with_its_number(tmp_path):
    path = write(tmp_path, [
        {"prompt": "ok"},                                                   # 1
        "{not json",                                                        # 2
        "[1, 2]",                                                           # 3
        {"max_tokens": 5},                                                  # 4
        {"prompt": "a", "messages": [{"role": "user", "content": "b"}]},    # 5
        {"prompt": ""},                                                     # 6
        {"prompt": "a", "max_tokens": 0},                                   # 7
        {"prompt": "a", "temperature": 2.5},                                # 8
        {"prompt": "a", "top_p": 0},                                        # 9
        {"prompt": "a", "top_k": -1},                                       # 10
        {"prompt": "a", "min_p": 1.5},                                      # 11
        {"prompt": "a", "repetition_penalty": 0},                           # 12
        {"prompt": "a", "seed": 2**63},                                     # 13
        {"prompt": "a", "stop": [""]},                                      # 14
        {"prompt": "a", "stop": ["s"] * 17},                                # 15
        {"messages": []},                                                   # 16
        {"messages": [{"role": "user"}]},                                   # 17
        {"messages": [{"role": "", "content": "x"}]},                       # 18
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},  # 19
        {"prompt": "a", "colour": "blue"},                                  # 20
        {"prompt": 5},                                                      # 21
        {"prompt": "a", "max_tokens": "10"},                                # 22
        {"prompt": "a", "ignore_eos": 1},                                   # 23
        {"prompt": "a", "max_tokens": 2.0},                                 # 24
        {"id": "", "prompt": "a"},                                          # 25
        {"prompt": "a", "stop": 3},                                         # 26
        '{"prompt": "\\ud800"}',                                            # 27
        {"prompt": "good again"},                                           # 28
    ])
    expected = {
        2: "invalid JSON", 3: "expected a JSON object", 4: "missing prompt or messages",
        5: "not both", 6: "prompt is empty", 7: "max_tokens must be between 1 and 1000000",
        8: "temperature must be a number between 0 and 2", 9: "top_p must be a number in (0, 1]",
        10: "top_k must be >= 0", 11: "min_p must be a number in [0, 1]",
        12: "repetition_penalty must be a number in (0, 10]", 13: "seed must be between",
        14: "stop strings must be non-empty", 15: "at most 16", 16: "non-empty list",
        17: "messages[0].content must be a string", 18: "messages[0].role must be a non-empty string",
        19: "content[0] has type 'image_url'; only text parts are supported", 20: "unknown field 'colour'",
        21: "prompt must be a non-empty string", 22: "max_tokens must be an integer",
        23: "ignore_eos must be true or false", 24: "max_tokens must be an integer",
        25: "id must be a non-empty string", 26: "stop must be a string or a list of strings",
        27: "unpaired surrogate",
    }
    got = errors_by_line(path)
    assert sorted(got) == sorted(expected)
    for line, fragment in expected.items():
        assert fragment in got[line], (line, got[line])
    assert validate(path).num_requests == 2


def test_only_the_chat_formats_roles_are_accepted(tmp_path):
    roles = ["system", "developer", "user", "assistant", "tool"]
    good = [{"id": role, "messages": [{"role": role, "content": "x"}, {"role": "user", "content": "y"}]}
            for role in roles]
    path = write(tmp_path, [*good,
                            {"messages": [{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}]},
                            {"messages": [{"role": "User", "content": "a"}]}])
    v = validate(path)
    assert v.num_requests == len(roles)
    assert [(e.line, e.message) for e in v.errors] == [
        (6, "messages[1].role must be one of system, developer, user, assistant, tool, got 'wizard'"),
        (7, "messages[0].role must be one of system, developer, user, assistant, tool, got 'User'")]
    batch = write(tmp_path, [batch_line("a", chat_body()),
                             batch_line("b", chat_body(messages=[{"role": "wizard", "content": "hi"}]))], "b.jsonl")
    assert [(e.line, "role must be one of" in e.message) for e in validate(batch).errors] == [(2, True)]


def test_all_problems_of_a_line_are_reported_together(tmp_path):
    path = write(tmp_path, [{"prompt": "a", "max_tokens": 0, "temperature": -1, "extra": 1}])
    message = errors_by_line(path)[1]
    for fragment in ("unknown field 'extra'", "max_tokens", "temperature"):
        assert fragment in message


@pytest.mark.parametrize("field,good,bad", [
    ("max_tokens", [1, 1_000_000], [0, 1_000_001]),
    ("temperature", [0, 2, 0.7], [-0.01, 2.01]),
    ("top_p", [1, 1e-9], [0, 1.01]),
    ("top_k", [0, 10**6], [-1]),
    ("min_p", [0, 1], [-0.1, 1.1]),
    ("repetition_penalty", [10, 1e-6], [0, 10.5]),
    ("seed", [-(2**63), 2**63 - 1, 0], [-(2**63) - 1, 2**63]),
])
def test_range_edges(tmp_path, field, good, bad):
    path = write(tmp_path, [{"prompt": "a", field: v} for v in good + bad])
    got = errors_by_line(path)
    assert sorted(got) == list(range(len(good) + 1, len(good) + len(bad) + 1))
    assert all(field in m for m in got.values())


def test_bools_nan_and_infinity_are_rejected(tmp_path):
    path = write(tmp_path, [
        {"prompt": "a", "max_tokens": True},
        {"prompt": "a", "temperature": False},
        {"prompt": "a", "seed": True},
        '{"prompt": "a", "temperature": NaN}',
        '{"prompt": "a", "top_p": Infinity}',
        '{"prompt": "a", "min_p": -Infinity}',
        '{"prompt": "a", "temperature": 1e400}',
        {"prompt": "a", "temperature": 1},
    ])
    got = errors_by_line(path)
    assert sorted(got) == [1, 2, 3, 4, 5, 6, 7]
    assert "got true" in got[1] and "got false" in got[2]
    assert "NaN" in got[4] and "Infinity" in got[5]
    assert "got inf" in got[7]


def test_duplicate_ids(tmp_path):
    path = write(tmp_path, [
        {"id": "a", "prompt": "x"},      # 1
        {"prompt": "x"},                 # 2 -> line-000002
        {"id": "a", "prompt": "y"},      # 3
        {"id": "line-000002", "prompt": "z"},  # 4
        {"id": "line-000006", "prompt": "z"},  # 5: an explicit id shaped like an auto id is fine
        {"id": "a", "prompt": "w"},      # 6
    ])
    got = errors_by_line(path)
    assert got == {3: "duplicate id 'a' (first on line 1)",
                   4: "duplicate id 'line-000002' (first on line 2)",
                   6: "duplicate id 'a' (first on line 1)"}


def test_auto_id_clashing_with_an_earlier_explicit_id(tmp_path):
    path = write(tmp_path, [{"id": "line-000002", "prompt": "x"}, {"prompt": "y"}])
    assert errors_by_line(path) == {2: "duplicate id 'line-000002' (first on line 1)"}


def test_empty_file_and_blank_only_file(tmp_path):
    for content in (b"", b"\n\n  \n"):
        path = tmp_path / "empty.jsonl"
        path.write_bytes(content)
        v = validate(str(path))
        assert not v.ok and v.num_requests == 0
        assert [e.line for e in v.errors] == [None]
        assert "no requests" in v.errors[0].message


def test_non_utf8_line(tmp_path):
    path = write(tmp_path, [{"prompt": "a"}, b'{"prompt": "\xff\xfe"}', {"prompt": "b"}])
    got = errors_by_line(path)
    assert list(got) == [2] and "UTF-8" in got[2]


def test_deep_nesting(tmp_path):
    nested = lambda levels: "[" * levels + "]" * levels  # noqa: E731
    path = write(tmp_path, [
        "[" * 100_000,                                            # would blow json's recursion
        "[" * 500 + "]" * 500,                                    # parses, but too deep
        '{"prompt": "a", "x": ' + nested(32) + "}",               # depth 33
        '{"prompt": "a", "x": ' + nested(31) + "}",               # depth 32: the limit
        {"prompt": "fine"},
    ])
    got = errors_by_line(path)
    assert sorted(got) == [1, 2, 3, 4]
    assert all("nested too deeply (the limit is 32 levels)" in got[i] for i in (1, 2, 3))
    assert "unknown field 'x'" in got[4] and "nested" not in got[4]


def test_overlong_line_is_skipped_and_reading_continues(tmp_path):
    limits = Limits(max_line_bytes=100)
    long_line = json.dumps({"prompt": "x" * 5000})
    exact = json.dumps({"prompt": "y" * (100 - len('{"prompt": ""}'))})
    assert len(exact) == 100
    path = write(tmp_path, [{"prompt": "a"}, long_line, exact, long_line + long_line, {"prompt": "b"}])
    got = errors_by_line(path, limits)
    assert sorted(got) == [2, 4] and "longer than 100 bytes" in got[2]
    assert [s.line for _, s in iter_lines(path, limits) if isinstance(s, RequestSpec)] == [1, 3, 5]


def test_overlong_last_line_without_newline(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n' + b"z" * 500)
    got = errors_by_line(str(path), Limits(max_line_bytes=100))
    assert list(got) == [2] and "longer than" in got[2]


def test_file_too_big(tmp_path):
    path = write(tmp_path, [{"prompt": "a" * 100}])
    v = validate(path, Limits(max_file_bytes=50))
    assert not v.ok and v.num_requests == 0
    assert [e.line for e in v.errors] == [None] and "limit is 50 bytes" in v.errors[0].message


def test_prompt_and_messages_char_limits(tmp_path):
    limits = Limits(max_prompt_chars=10)
    path = write(tmp_path, [
        {"prompt": "a" * 10},
        {"prompt": "a" * 11},
        {"messages": [{"role": "user", "content": "a" * 6}, {"role": "assistant", "content": "b" * 5}]},
    ])
    got = errors_by_line(path, limits)
    assert sorted(got) == [2, 3] and "limit is 10" in got[2] and "limit is 10" in got[3]


def test_too_many_requests(tmp_path):
    path = write(tmp_path, [{"prompt": "a"}] * 4)
    v = validate(path, Limits(max_requests=3))
    assert [e.line for e in v.errors] == [4] and "more than 3 requests" in v.errors[0].message


def test_errors_are_capped_but_counted(tmp_path):
    path = write(tmp_path, ["nope"] * 30)
    v = validate(path, Limits(max_errors_kept=10))
    assert (v.num_errors, len(v.errors)) == (30, 10)
    assert [e.line for e in v.errors] == list(range(1, 11))
    text = str(InvalidInput(v, shown=5))
    assert text.splitlines()[0] == "30 error(s) in the input file:"
    assert text.splitlines()[1:6] == [f"line {i}: " + v.errors[0].message for i in range(1, 6)]
    assert text.splitlines()[-1] == "... and 25 more"


def test_line_error_str():
    assert str(LineError(7, "bad")) == "line 7: bad"
    assert str(LineError(None, "bad file")) == "bad file"


# --- formats ------------------------------------------------------------------------------

def test_mixed_formats_are_rejected_with_line_numbers(tmp_path):
    path = write(tmp_path, ["oops", {"prompt": "a"}, batch_line("r", chat_body()), {"prompt": "b"}])
    got = errors_by_line(path)
    assert sorted(got) == [1, 3]
    assert "OpenAI batch line" in got[3] and "(line 2)" in got[3] and "pipeline format" in got[3]

    path = write(tmp_path, [batch_line("r", chat_body()), {"prompt": "b"}], name="b.jsonl")
    got = errors_by_line(path)
    assert list(got) == [2] and "pipeline-format line" in got[2] and "(line 1)" in got[2]


def test_openai_urls_must_agree(tmp_path):
    path = write(tmp_path, [batch_line("a", chat_body()), batch_line("b", {"prompt": "x"}, url=COMPLETIONS)])
    got = errors_by_line(path)
    assert list(got) == [2] and "differs from '/v1/chat/completions' of line 1" in got[2]


def test_openai_line_errors(tmp_path):
    path = write(tmp_path, [
        batch_line("ok", chat_body()),                                      # 1
        batch_line("m", chat_body(), method="GET"),                         # 2
        batch_line("u", chat_body(), url="/v1/moderations"),                 # 3
        {"custom_id": "nb", "method": "POST", "url": CHAT},                 # 4
        batch_line("ok", chat_body()),                                      # 5
        batch_line("lp", chat_body(logprobs=True, top_logprobs=21)),        # 6
        batch_line("n2", chat_body(n=129)),                                 # 7
        batch_line("both", chat_body(max_tokens=3, max_completion_tokens=3)),  # 8
        {"method": "POST", "url": CHAT, "body": chat_body()},               # 9
        {**batch_line("x", chat_body()), "extra": 1},                       # 10
        batch_line("p", {"prompt": "hi"}),                                  # 11
        batch_line("s", chat_body(stream=True, tools=[])),                  # 12
        batch_line("mc", chat_body(max_completion_tokens=0)),               # 13
        batch_line("b", "not an object"),                                   # 14
        batch_line("md", chat_body(model=3)),                               # 15
        batch_line("ok2", chat_body(n=1, model=None)),                      # 16
    ])
    expected = {
        2: 'method must be "POST"', 3: "unknown url '/v1/moderations'", 4: "missing body",
        5: "duplicate id 'ok' (first on line 1)", 6: "top_logprobs must be between 0 and 20",
        7: "n must be between 1 and 128, got 129", 8: "not both", 9: "missing custom_id",
        10: "unknown field 'extra'", 11: "unsupported field 'prompt'",
        12: "unsupported field 'stream'", 13: "max_completion_tokens must be between 1",
        14: "body must be an object", 15: "model must be a non-empty string",
    }
    got = errors_by_line(path)
    assert sorted(got) == sorted(expected)
    for line, fragment in expected.items():
        assert fragment in got[line], (line, got[line])
    # tools are taken now (forced tool calls); an empty list of them is still a bad line
    assert "missing body.messages" in got[11] and "tools must be a list of 1 to 128 function tools" in got[12]


def test_openai_completions_take_a_prompt_not_messages(tmp_path):   # its list forms: test_input_fields
    path = write(tmp_path, [
        batch_line("a", {"prompt": "x"}, url=COMPLETIONS),
        batch_line("c", {"messages": [{"role": "user", "content": "x"}]}, url=COMPLETIONS),
    ])
    got = errors_by_line(path)
    assert sorted(got) == [2]
    assert "unsupported field 'messages'" in got[2] and "missing body.prompt" in got[2]


# --- shards -------------------------------------------------------------------------------

def test_write_shards_round_trip(tmp_path):
    lines = [{"id": f"r{i}", "prompt": f"p{i}", "seed": i} for i in range(7)]
    lines.insert(3, {"messages": [{"role": "user", "content": "hé"}], "stop": "x"})
    path = write(tmp_path, lines)
    shard_dir = tmp_path / "shards"
    assert write_shards(path, str(shard_dir), 3)[1] == [3, 3, 2]
    assert sorted(os.listdir(shard_dir)) == [shard_file_name(i) for i in range(3)]
    assert shard_file_name(0) == "shard-00000.jsonl"
    loaded = [s for i in range(3) for s in read_shard(str(shard_dir / shard_file_name(i)))]
    assert loaded == specs(path)
    first_line = json.loads((shard_dir / shard_file_name(0)).read_text().splitlines()[0])
    assert set(first_line) == {"id", "line", "prompt", "messages", "max_tokens", "temperature", "top_p",
                               "top_k", "min_p", "repetition_penalty", "seed", "stop", "ignore_eos"}


def test_write_shards_keeps_model_of_openai_lines(tmp_path):
    path = write(tmp_path, [batch_line("a", chat_body()), batch_line("b", {"messages": [
        {"role": "user", "content": "x"}]})])
    shard_dir = tmp_path / "s"
    assert write_shards(path, str(shard_dir), 10)[1] == [2]
    a, b = read_shard(str(shard_dir / shard_file_name(0)))
    assert (a.model, b.model) == ("gpt-x", None)
    assert a.to_dict()["model"] == "gpt-x" and "model" not in b.to_dict()
    assert RequestSpec.from_dict(a.to_dict()) == a


def test_write_shards_writes_nothing_on_error(tmp_path):
    path = write(tmp_path, [{"prompt": "a"}, {"prompt": "b", "top_p": 2}, {"prompt": "c"}])
    shard_dir = tmp_path / "shards"
    with pytest.raises(InvalidInput) as info:
        write_shards(path, str(shard_dir), 1)
    assert info.value.validation.num_errors == 1
    assert "line 2: top_p" in str(info.value)
    assert not shard_dir.exists()


def test_write_shards_rejects_bad_shard_size(tmp_path):
    with pytest.raises(ValueError):
        write_shards(write(tmp_path, [{"prompt": "a"}]), str(tmp_path / "s"), 0)


# --- fuzzing ------------------------------------------------------------------------------

_KEYS = ["id", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p",
         "repetition_penalty", "seed", "stop", "ignore_eos", "custom_id", "method", "url", "body",
         "model", "n", "max_completion_tokens", "role", "content", "logprobs"]
_scalars = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
            | st.sampled_from(["POST", CHAT, COMPLETIONS, "user", "line-000001"]))
_json = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.sampled_from(_KEYS) | st.text(max_size=4), inner, max_size=5),
                     max_leaves=20)
_objects = st.dictionaries(st.sampled_from(_KEYS), _json, max_size=6)
_line = (st.binary(max_size=40) | _json.map(json.dumps).map(str.encode)
         | _objects.map(json.dumps).map(str.encode))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=st.lists(_line, max_size=8), newline_at_end=st.booleans(), small=st.booleans())
def test_fuzz_never_raises_and_numbers_lines(lines, newline_at_end, small):
    data = b"\n".join(lines) + (b"\n" if newline_at_end and lines else b"")
    line_count = data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)
    limits = Limits(max_line_bytes=64, max_depth=3) if small else Limits()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "in.jsonl")
        with open(path, "wb") as f:
            f.write(data)
        items = list(iter_lines(path, limits))
        v = validate(path, limits)
    specs_ = [i for _, i in items if isinstance(i, RequestSpec)]
    errors = [i for _, i in items if isinstance(i, LineError)]
    assert len(specs_) + len(errors) == len(items)
    # The file-wide checks come on top of each line's: a file with no request is refused, and a
    # request whose id an earlier line claimed becomes an error (so no more than its distinct ids stay valid).
    assert v.num_requests + v.num_errors == len(items) + (not items)
    assert v.num_requests <= len({s.id for s in specs_}) and v.num_errors >= len(errors)
    assert v.ok == (bool(items) and not errors and len({s.id for s in specs_}) == len(specs_))
    for number, item in items:
        if item.line is None:
            assert number == 0
        else:
            assert number == item.line and 1 <= item.line <= line_count
        if isinstance(item, LineError):
            str(item).encode("utf-8")  # messages go to logs and the ledger: no lone surrogates
    assert all(s.to_dict() == RequestSpec.from_dict(json.loads(json.dumps(s.to_dict()))).to_dict()
               for s in specs_)


def test_a_line_naming_another_model_than_the_jobs_is_refused(tmp_path):
    lines = [batch_line("a", chat_body(model="/models/Qwen2.5-0.5B-Instruct")),  # the job's model as given
             batch_line("b", chat_body(model="Qwen2.5-0.5B-Instruct")),          # its directory's name
             batch_line("c", chat_body(model="gpt-4o")),
             batch_line("d", {k: v for k, v in chat_body().items() if k != "model"})]
    path = write(tmp_path, lines)
    v = validate(path, model="/models/Qwen2.5-0.5B-Instruct")
    assert [(e.line, e.message.split(";")[0]) for e in v.errors] == [
        (3, "model 'gpt-4o' is not the job's model '/models/Qwen2.5-0.5B-Instruct'")]
    assert validate(path).ok  # without a job model nothing is compared
    with pytest.raises(InvalidInput):
        write_shards(path, str(tmp_path / "s"), 10, model="/models/Qwen2.5-0.5B-Instruct")
    assert not (tmp_path / "s").exists()


def test_numbers_out_of_any_range_duplicate_keys_and_cr_line_ends_are_line_errors(tmp_path):
    huge = "9" * 401
    path = write(tmp_path, [
        '{"id": "a", "prompt": "x", "timeout_s": ' + huge + '}',
        '{"id": "b", "prompt": "x", "temperature": -' + huge + '}',
        '{"id": "k", "id": "k2", "prompt": "x"}',
        '{"id": "c", "prompt": "x", "top_p": 1e400}',
        b'{"id": "d", "prompt": "x"}\r{"id": "e", "prompt": "y"}',
        '{"id": "f", "prompt": "fine", "seed": ' + huge + '}',
    ])
    errors = errors_by_line(path)
    assert "timeout_s must be a number > 0, got an integer of 401 digits" in errors[1]
    assert "temperature must be a number between 0 and 2, got an integer of 402 digits" in errors[2]
    assert "the key 'id' appears twice" in errors[3]
    assert "top_p must be a number in (0, 1], got inf" in errors[4]
    assert "carriage return" in errors[5] and "CR alone" in errors[5]
    assert "seed must be between" in errors[6]


def test_penalties_and_logit_bias_are_checked_and_kept(tmp_path):
    path = write(tmp_path, [
        {"id": "ok", "prompt": "x", "frequency_penalty": 1.5, "presence_penalty": -0.5, "logit_bias": {"42": -100}},
        {"id": "f", "prompt": "x", "frequency_penalty": 2.5},
        {"id": "b", "prompt": "x", "logit_bias": {"abc": 1}},
        {"id": "v", "prompt": "x", "logit_bias": {"7": 101}},
        batch_line("o", chat_body(presence_penalty=1, logit_bias={"5": 5})),
    ])
    errors = errors_by_line(path)
    assert set(errors) == {2, 3, 4, 5}   # the OpenAI line in a pipeline-format file is refused as such
    assert "frequency_penalty must be a number between -2 and 2" in errors[2]
    assert "logit_bias keys must be token ids" in errors[3]
    assert "between -100 and 100" in errors[4]
    (ok,) = [item for _, item in iter_lines(path) if isinstance(item, RequestSpec)]
    assert (ok.frequency_penalty, ok.presence_penalty, ok.logit_bias) == (1.5, -0.5, {"42": -100.0})
    openai = write(tmp_path, [batch_line("o", chat_body(presence_penalty=1, logit_bias={"5": 5}))], name="o.jsonl")
    (spec,) = [item for _, item in iter_lines(openai)]
    assert (spec.presence_penalty, spec.logit_bias) == (1.0, {"5": 5.0})


def test_embedding_lines_in_both_formats(tmp_path):
    """OpenAI /v1/embeddings bodies and pipeline-format `input` lines: one row (n) per input,
    every problem named with its line; a file is all embeddings or all generation."""
    openai = write(tmp_path, [
        batch_line("one", {"model": "m", "input": "hello"}, url="/v1/embeddings"),                      # 1
        batch_line("many", {"input": ["a", "b", "c"], "dimensions": 8, "encoding_format": "base64"},
                   url="/v1/embeddings"),                                                               # 2
        batch_line("ids", {"input": [[1, 2], [3]], "encoding_format": "float", "user": "u"}, url="/v1/embeddings"),  # 3
        batch_line("bad", {"input": [1, "x"], "dimensions": 0, "encoding_format": "hex", "n": 2},
                   url="/v1/embeddings"),                                                               # 4
        batch_line("empty", {"input": []}, url="/v1/embeddings"),                                       # 5
        batch_line("none", {"model": "m"}, url="/v1/embeddings"),                                       # 6
        batch_line("chat", chat_body()),                                                                # 7
    ], "e.jsonl")
    items = dict(iter_lines(openai))
    specs = {n: item for n, item in items.items() if isinstance(item, RequestSpec)}
    assert [(s.id, s.input, s.n, s.dimensions, s.encoding_format) for s in specs.values()] == [
        ("one", ["hello"], 1, None, None), ("many", ["a", "b", "c"], 3, 8, "base64"), ("ids", [[1, 2], [3]], 2, None, None)]
    assert all(s.is_embedding and s.prompt is None and s.messages is None for s in specs.values())
    assert RequestSpec.from_dict(specs[2].to_dict()) == specs[2]
    errors = {n: str(item) for n, item in items.items() if not isinstance(item, RequestSpec)}
    assert "not a mix" in errors[4] and "dimensions must be between 1 and 65536" in errors[4]
    assert "encoding_format must be \"float\" or \"base64\"" in errors[4] and "unsupported field 'n'" in errors[4]
    assert "input must be a string, a list" in errors[5] and "missing input" in errors[6]
    assert "differs from '/v1/embeddings' of line 1" in errors[7]
    assert validate(openai).endpoint == "/v1/embeddings"

    ours = write(tmp_path, [{"id": "a", "input": "text"}, {"id": "b", "input": ["x", "y"], "dimensions": 2},
                            {"id": "c", "prompt": "hi"}, {"id": "d", "input": "x", "temperature": 0}], "p.jsonl")
    items = dict(iter_lines(ours))
    assert items[2].n == 2 and items[2].dimensions == 2
    assert "a generation line (prompt or messages) in a file whose first request (line 1) is an embedding line" in str(items[3])
    assert "unknown field 'temperature' (allowed in an embedding line" in str(items[4])


def test_token_ids_beyond_the_models_vocabulary_are_line_errors(tmp_path):
    """Prompts and embedding inputs given as ids, and logit_bias keys: an id the model has no
    row for is refused with its line, whatever form carries it; ids within it pass."""
    limits = Limits(vocab_size=100)
    path = write(tmp_path, [
        batch_line("ok", {"prompt": [0, 99], "logit_bias": {"99": 1}}, url=COMPLETIONS),
        batch_line("one", {"prompt": [1, 100]}, url=COMPLETIONS),
        batch_line("many", {"prompt": [[1], [2, 3, 250]]}, url=COMPLETIONS),
        batch_line("bias", {"prompt": "hi", "logit_bias": {"5": 1, "100": -1}}, url=COMPLETIONS),
    ])
    assert errors_by_line(path, limits) == {
        2: "prompt holds token id 100; the model's vocabulary has ids 0 to 99",
        3: "prompt[1] holds token id 250; the model's vocabulary has ids 0 to 99",
        4: "logit_bias names token id 100; the model's vocabulary has ids 0 to 99",
    }
    assert errors_by_line(path) == {}   # no model's vocabulary known: left to the engine
    embeddings = write(tmp_path, [{"id": "e1", "input": [[5, 6], [7, 100]]}, {"id": "e2", "input": [99]}], "emb.jsonl")
    assert errors_by_line(embeddings, limits) == {
        1: "input[1] holds token id 100; the model's vocabulary has ids 0 to 99"}
