"""The plain-line path (jobs.input.plain_lines) only ever accepts what the full checks accept, as
the same request line, and it does take the common lines."""
from __future__ import annotations

import json

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobs.input.field_checks import Bad
from jobs.input.line_checks import Limits, _Reader
from jobs.input.validation import RangeOutcome

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
LIMITS = Limits(max_id_chars=8, max_prompt_chars=40)
_encode = msgspec.json.Encoder(order="sorted").encode

TEXTS = ["a", "", "x" * 41, "\ud800", "é ok", "y" * 8, "id-9", 5, None, ["a"], {"a": 1}]
VALUES = [None, True, False, 0, 1, -1, 0.5, 1.0, 2, 2.5, 10, 11, 129, 1e-9, 1e308, 10**30, 2**63, -2**63 - 1,
          "1", [], [1], 16, 1_000_000, 1_000_001]
STOPS = ["\n", "", ["a", "b"], [""], ["a"] * 17, ["a"] * 16, [1], "\ud800", ["é"], None]
MESSAGES = [[{"role": "user", "content": "hi"}], [], [{"role": "robot", "content": "x"}],
            [{"role": "user", "content": "hi", "name": "n"}], [{"role": "user", "content": ["part"]}],
            [{"role": "system", "content": ""}, {"role": "user", "content": "z" * 41}],
            [{"role": "assistant", "content": "\ud800"}], "hi", None]
SAMPLING = ["max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
            "presence_penalty", "seed", "ignore_eos", "n"]


# Values each setting accepts, drawn most of the time, so that many whole lines are valid.
VALID = {"max_tokens": [1, 16, 1_000_000], "temperature": [0, 0.7, 2, 2.0], "top_p": [0.1, 1, 1.0], "top_k": [0, 5, 10**30],
         "min_p": [0, 1.0], "repetition_penalty": [0.5, 10], "frequency_penalty": [-2, 0, 0.0, 1.5],
         "presence_penalty": [2, 0], "seed": [0, -5, 2**63 - 1], "ignore_eos": [True, False], "n": [1, 128]}


def mostly(valid: list, edges: list) -> st.SearchStrategy:
    return st.sampled_from(valid * (3 * len(edges) // len(valid) + 1) + edges)


def fields(extra: dict) -> st.SearchStrategy[dict]:
    pool = {**{k: mostly(VALID[k], VALUES) for k in SAMPLING}, "stop": mostly(["\n", ["a", "b"], ["é"]], STOPS),
            "logit_bias": st.just({"5": 1}), "unknown": st.just(1), **extra}
    return st.dictionaries(st.sampled_from(sorted(pool)), st.none(), max_size=6).flatmap(
        lambda keys: st.fixed_dictionaries({k: pool[k] for k in keys}))


PIPELINE = st.tuples(fields({"id": mostly(["a", "é ok", None], TEXTS), "timeout_s": mostly([1, 0.5], VALUES)}),
                     st.sampled_from([{}, {"prompt": "hi", "messages": MESSAGES[0]}] + [{"prompt": t} for t in TEXTS]
                                     + [{"messages": m} for m in MESSAGES]))


def reader(plain: bool, fmt: str, endpoint: str | None, model=None) -> _Reader:
    start = RangeOutcome(input_format=fmt, format_line=1, endpoint=endpoint, endpoint_line=1)
    return _Reader(LIMITS, model, start, plain=plain)


def same_as_full_checks(obj: dict, fmt: str, endpoint: str | None, model=None) -> bool:
    """Whether the plain path took the line; asserts what it made is the full checks' line."""
    fast_reader = reader(True, fmt, endpoint, model)
    fast = fast_reader._plain_line(7, obj, fmt)
    if fast is None:
        return False
    fast["id"] = fast["id"] or "line-000007"
    slow_reader = reader(False, fmt, endpoint, model)
    try:
        slow = slow_reader._request(7, json.loads(json.dumps(obj)))
    except Bad as e:
        raise AssertionError(f"the plain path took a line the full checks refuse ({e}): {obj!r}") from None
    assert _encode(fast) == _encode(slow), obj
    return True


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(PIPELINE)
def test_a_pipeline_line_taken_is_the_full_checks_line(parts):
    settings_, inputs = parts
    same_as_full_checks({**inputs, **settings_}, "pipeline", None)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fields({"model": mostly(["gpt-x"], ["other", "", "m" * 9, 3]),
               "max_completion_tokens": mostly([1, 64], VALUES)}),
       mostly(["a", "é ok"], TEXTS), st.sampled_from([CHAT, COMPLETIONS]), st.sampled_from(MESSAGES + ["hello"]),
       st.sampled_from([CHAT, COMPLETIONS, "/v1/embeddings"]), st.sampled_from(["POST", "GET"]))
def test_an_openai_line_taken_is_the_full_checks_line(body, custom_id, endpoint, inputs, url, method):
    key = "messages" if endpoint == CHAT else "prompt"
    body = {**body, **({key: inputs} if not isinstance(inputs, list) or key == "messages" else {})}
    obj = {"custom_id": custom_id, "method": method, "url": url, "body": body}
    same_as_full_checks(obj, "openai", endpoint, ("gpt-x",))


def test_the_common_lines_are_taken():
    """Not a path that refuses everything: the usual lines of both formats go through it."""
    lines = [({"id": "a1", "prompt": "hello", "max_tokens": 64, "temperature": 0}, "pipeline", None),
             ({"prompt": "no id", "stop": "\n", "seed": 3, "top_p": 0.9, "n": 2}, "pipeline", None),
             ({"id": "é-1", "messages": [{"role": "system", "content": "be brief"},
                                         {"role": "user", "content": "¿qué?"}], "timeout_s": 5}, "pipeline", None),
             ({"custom_id": "r1", "method": "POST", "url": CHAT,
               "body": {"model": "gpt-x", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9,
                        "temperature": 0.2, "presence_penalty": 0.5}}, "openai", CHAT),
             ({"custom_id": "r2", "method": "POST", "url": COMPLETIONS,
               "body": {"prompt": "Once", "max_tokens": 5, "stop": ["\n", "."]}}, "openai", COMPLETIONS)]
    for obj, fmt, endpoint in lines:
        assert same_as_full_checks(obj, fmt, endpoint, ("gpt-x",) if fmt == "openai" else None), obj
