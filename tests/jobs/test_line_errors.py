"""Bad input lines (jobs.input.line_checks): every one reported with its line number and all its
problems, whatever the format; on real files. (Good lines and shards: test_spec.py.)"""
from __future__ import annotations

import json

import pytest

from input_files import COMPLETIONS, CHAT, batch_line, chat_body, errors_by_line, write
from jobs.input.file_scan import write_input_shards as write_shards
from jobs.input.line_checks import InvalidInput, LineError, Limits, RequestSpec, iter_lines, validate


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


# --- the job's model, numbers and token ids -----------------------------------------------

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
