"""Job input validation and sharding (jobs.input.line_checks), on real files: what good lines
become (RequestSpec, its sampling settings SamplingParams' own), the shard files and their lines,
old ones included. (Bad lines: test_line_errors.py.)"""
from __future__ import annotations

import json
import os
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from input_files import COMPLETIONS, CHAT, batch_line, chat_body, errors_by_line, specs, write
from jobs.paths import input_shard_name as shard_file_name
from jobs.input.file_scan import write_input_shards as write_shards
from jobs.input.shard_files import read_shard
from jobs.input.line_checks import InvalidInput, LineError, Limits, RequestSpec, iter_lines, validate


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


# Shard lines as the code before RequestSpec took its sampling fields from SamplingParams wrote
# them (and one older still, with its key): they load, and are written back the same, so code
# on either side of that change reads the other's shards.
OLD_SHARD_LINES = [
    '{"id":"p","line":1,"prompt":"hi","messages":null,"max_tokens":16,"temperature":0.0,"top_p":1.0,"top_k":0,'
    '"min_p":0.0,"repetition_penalty":1.0,"frequency_penalty":0.5,"presence_penalty":-1.0,'
    '"logit_bias":{"42":-100.0},"seed":7,"stop":["\\n"],"ignore_eos":false,"n":3,"timeout_s":30.0,'
    '"structured_output":{"json_object":true},"logprobs":2}',
    '{"id":"c","line":1,"prompt":null,"messages":[{"role":"user","content":"weather?"}],"max_tokens":256,'
    '"temperature":1.0,"top_p":1.0,"top_k":0,"min_p":0.0,"repetition_penalty":1.0,"seed":null,"stop":[],'
    '"ignore_eos":false,"model":"m","structured_output":{"json":{"type":"object"}},"tools":[{"type":"function",'
    '"function":{"name":"f","parameters":{"type":"object"}}}],"tool_call":"f"}',
    '{"id":"k","line":1,"prompt":null,"messages":null,"prompts":["a","b"],"max_tokens":256,"temperature":1.0,'
    '"top_p":1.0,"top_k":0,"min_p":0.0,"repetition_penalty":1.0,"seed":null,"stop":[],"ignore_eos":false,"n":2,'
    '"logprobs":1,"echo":true}',
    '{"id":"e","line":1,"prompt":null,"messages":null,"max_tokens":256,"temperature":1.0,"top_p":1.0,"top_k":0,'
    '"min_p":0.0,"repetition_penalty":1.0,"seed":null,"ignore_eos":false,"stop":[],"n":2,"input":["a","b"],'
    '"dimensions":8,"encoding_format":"base64"}',
    '{"id": "old", "line": 4, "prompt": "x", "messages": null, "max_tokens": 5, "temperature": 0.0, "top_p": 1.0, '
    '"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "seed": null, "stop": [], "ignore_eos": false, '
    '"key": "0123456789abcdef0123456789abcdef"}',
]


def test_shard_lines_written_before_sampling_params_fields_load_and_are_written_the_same(tmp_path):
    from workers.shard_requests import prompt_requests, to_request

    path = tmp_path / shard_file_name(0)
    path.write_text("".join(line + "\n" for line in OLD_SHARD_LINES))
    p, c, k, e, old = read_shard(str(path))
    assert [spec.to_dict() for spec in (p, c, k, e, old)] == [json.loads(line) for line in OLD_SHARD_LINES]
    assert (p.frequency_penalty, p.presence_penalty, p.logit_bias, p.n, p.logprobs, p.seed, p.stop) == (
        0.5, -1.0, {"42": -100.0}, 3, 2, 7, ["\n"])
    assert p.to_dict()["logit_bias"] == {"42": -100.0}   # token ids stay strings in the line (JSON's keys)
    params = to_request(p).params
    assert (params.max_tokens, params.temperature, params.frequency_penalty, params.presence_penalty,
            params.logit_bias, params.n, params.logprobs, params.seed, params.stop, params.structured_output,
            params.prompt_logprobs) == (16, 0.0, 0.5, -1.0, {42: -100.0}, 3, 2, 7, ["\n"], {"json_object": True}, None)
    assert (c.model, c.tool_call, to_request(c).params.structured_output) == ("m", "f", {"json": {"type": "object"}})
    assert [(r.params.n, r.params.logprobs, r.params.prompt_logprobs) for r in prompt_requests(k)] == [(2, 1, 1)] * 2
    assert (e.is_embedding, e.n, e.dimensions, e.encoding_format) == (True, 2, 8, "base64")
    assert (old.key, old.frequency_penalty, old.n, old.structured_output) == ("0123456789abcdef0123456789abcdef",
                                                                               0.0, 1, None)


def test_request_spec_takes_its_sampling_settings_from_sampling_params():
    """SamplingParams declares each sampling setting once: RequestSpec has every one a line may
    give (its default too), and the engine request made of a spec carries each of them."""
    from dataclasses import fields

    from jobs.input.request_spec import ENGINE_ONLY, OPTIONAL_FIELDS
    from pipeline.sampling_params import SamplingParams
    from workers.shard_requests import to_request

    ours = {f.name: f for f in fields(RequestSpec)}
    for f in fields(SamplingParams):
        if f.name in ENGINE_ONLY:
            assert f.name not in ours
        else:
            assert (ours[f.name].default, ours[f.name].default_factory) == (f.default, f.default_factory), f.name
    assert {"frequency_penalty", "presence_penalty", "logit_bias", "structured_output", "logprobs", "n"} <= set(
        OPTIONAL_FIELDS)
    assert to_request(RequestSpec(id="a", line=1, prompt="x", messages=None)).params == SamplingParams()
    given = {"max_tokens": 9, "temperature": 0.5, "top_p": 0.9, "top_k": 3, "min_p": 0.1, "repetition_penalty": 1.1,
             "frequency_penalty": 0.2, "presence_penalty": 0.3, "logit_bias": {"5": 1.0}, "seed": 4, "stop": ["x"],
             "ignore_eos": True, "structured_output": {"choice": ["a", "b"]}, "logprobs": 1, "n": 2}
    assert set(given) == {f.name for f in fields(SamplingParams)} - ENGINE_ONLY, "give a new setting a value here"
    params = to_request(RequestSpec(id="a", line=1, prompt="x", messages=None, **given)).params
    assert {name: getattr(params, name) for name in given} == {**given, "logit_bias": {5: 1.0}}


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
