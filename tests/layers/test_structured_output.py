"""Structured outputs on real weights: every constrained answer parses and validates.

The bundled SmolLM2-135M-Instruct answers JSON-schema, JSON-mode, regex, choice and Lark
requests (checked with jsonschema, json, re and lark); the tiny random Llama checks how
constraints compose with the engine (preemption, prefix caching, unconstrained neighbours).
Through a whole job, OpenAI lines in and out: test_structured_output_jobs.py.
"""
from __future__ import annotations

import json
import re

import jsonschema
import lark
import pytest
import torch

from pipeline import Engine, EngineConfig, Request, SamplingParams
from pipeline.structured_output import check
from structured_output_helpers import SCHEMA

MOVIES = ["Titanic", "Jaws", "Alien", "Up", "Heat", "Rocky", "Psycho", "Fargo", "Casablanca", "Vertigo",
          "Amelie", "Shrek", "Cars", "Frozen", "Coco", "Inception", "Gladiator", "Memento", "Big", "Babe"]
ARITHMETIC = r"""
start: sum
sum: NUMBER OP NUMBER
OP: "+" | "-"
NUMBER: /[0-9]{1,3}/
"""


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()   # as in test_engine: small matmuls on a shared 2-core box
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def bundled_engine():
    return Engine(EngineConfig(device="cpu", dtype="float32", num_kv_blocks=256, max_num_seqs=64))


def ask(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def run(engine, requests):
    return {out.id: out for out in engine.generate(requests)}


@pytest.fixture(scope="module")
def movie_answers(bundled_engine):
    """20 greedy and 20 sampled schema answers, plus every other kind, in one batch."""
    spec = {"json": SCHEMA}
    requests = [Request(f"greedy-{m}", messages=ask(f"Describe the movie {m} as JSON."),
                        params=SamplingParams(temperature=0, max_tokens=200, structured_output=spec))
                for m in MOVIES]
    requests += [Request(f"sampled-{i}", messages=ask(f"Describe the movie {m} as JSON."),
                         params=SamplingParams(temperature=0.9, top_p=0.95, seed=i, max_tokens=200,
                                               structured_output=spec))
                 for i, m in enumerate(MOVIES)]
    requests += [
        Request("json-mode", messages=ask("Reply with a JSON object with the keys city and country, for Paris."),
                params=SamplingParams(temperature=0, max_tokens=200, structured_output={"json_object": True})),
        Request("date", messages=ask("When did the French revolution start?"),
                params=SamplingParams(temperature=0, max_tokens=20,
                                      structured_output={"regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"})),
        Request("choice", messages=ask("Is the sky blue? Answer yes or no."),
                params=SamplingParams(temperature=0.7, seed=1, max_tokens=10,
                                      structured_output={"choice": ["yes", "no", "maybe"]})),
        Request("lark", messages=ask("Write a sum of two small numbers."),
                params=SamplingParams(temperature=0, max_tokens=20, structured_output={"grammar": ARITHMETIC})),
        Request("free", messages=ask("What is the capital of France?"), params=SamplingParams(temperature=0,
                                                                                               max_tokens=12)),
    ]
    return run(bundled_engine, requests)


def test_every_schema_answer_parses_and_validates(movie_answers):
    answers = [out for key, out in movie_answers.items() if key.startswith(("greedy-", "sampled-"))]
    assert len(answers) == 40
    for out in answers:
        assert out.finish_reason == "stop" and out.valid is True, (out.id, out.text)
        jsonschema.validate(json.loads(out.text), SCHEMA)
    sampled = {movie_answers[f"sampled-{i}"].text for i in range(20)}
    assert len(sampled) > 10   # sampling still samples, within the grammar


def test_json_mode_regex_choice_and_lark_answers_follow_their_grammar(movie_answers):
    assert movie_answers["json-mode"].finish_reason == "stop", movie_answers["json-mode"].text
    assert isinstance(json.loads(movie_answers["json-mode"].text), dict)
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", movie_answers["date"].text)
    assert movie_answers["choice"].text in ("yes", "no", "maybe")
    lark.Lark(ARITHMETIC, start="start").parse(movie_answers["lark"].text)
    assert all(movie_answers[k].valid for k in ("json-mode", "date", "choice", "lark"))
    free = movie_answers["free"]
    assert free.valid is None and "Paris" in free.text


def test_an_answer_cut_by_max_tokens_is_reported_invalid(bundled_engine):
    out = run(bundled_engine, [Request("short", messages=ask("Describe Titanic as JSON."),
                                       params=SamplingParams(temperature=0, max_tokens=5,
                                                             structured_output={"json": SCHEMA}))])["short"]
    assert out.finish_reason == "length" and out.valid is False
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


# ---- composition, on the tiny model -------------------------------------------------------

LOOSE = {"json": {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "string"}}},
                  "required": ["a"]}}


@pytest.fixture(scope="module")
def tiny_engines(tiny_model_dir):
    big = Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), num_kv_blocks=512, block_size=16,
                              max_num_batched_tokens=64, max_num_seqs=32))
    small = Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), num_kv_blocks=24, block_size=4,
                                max_num_batched_tokens=64, max_num_seqs=32))
    return big, small


PREAMBLE = "You are a careful assistant who answers in JSON. " * 4   # a few full blocks to cache


def constrained(i: int, max_tokens: int = 40) -> Request:
    return Request(f"c{i}", prompt=f"{PREAMBLE}Item {i}:", params=SamplingParams(temperature=0.8, seed=i, max_tokens=max_tokens,
                                                                      structured_output=LOOSE))


def free(i: int) -> Request:
    return Request(f"f{i}", prompt=f"Free text {i}", params=SamplingParams(temperature=0, max_tokens=24,
                                                                           ignore_eos=True))


def test_unconstrained_neighbours_get_the_same_tokens(tiny_engines):
    big, _ = tiny_engines
    alone = run(big, [free(i) for i in range(4)])
    mixed = run(big, [r for i in range(4) for r in (constrained(i), free(i))])
    assert {k: v.token_ids for k, v in alone.items()} == {f"f{i}": mixed[f"f{i}"].token_ids for i in range(4)}
    assert all(mixed[f"c{i}"].token_ids for i in range(4))


def test_preempted_and_prefix_cached_constrained_requests_give_the_same_answers(tiny_engines):
    big, small = tiny_engines
    alone = {i: run(big, [constrained(i)])[f"c{i}"] for i in range(6)}
    preemptions = small.scheduler.num_preemptions
    crowded = run(small, [constrained(i) for i in range(6)])
    assert small.scheduler.num_preemptions > preemptions   # the pool is too small for all six at once
    cached = run(big, [constrained(i) for i in range(6)])   # their prompts are in the prefix cache now
    assert any(out.cached_tokens for out in cached.values())
    for i in range(6):
        assert crowded[f"c{i}"].token_ids == alone[i].token_ids == cached[f"c{i}"].token_ids
        assert crowded[f"c{i}"].valid == alone[i].valid


def test_constrained_requests_are_never_drafted(tiny_model_dir):
    engine = Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), num_kv_blocks=256, block_size=16,
                                 speculative="ngram", num_speculative_tokens=4))
    outs = run(engine, [constrained(i) for i in range(3)])
    assert all(out.draft_tokens == 0 and out.token_ids for out in outs.values())


@pytest.mark.parametrize("spec, says", [
    ({"json": {"type": "object", "properties": {"a": {"type": "strung"}}}}, "strung"),
    ({"regex": "[a-"}, "unclosed character class"),
    ({"grammar": "start: foo"}, "unknown name"),
    ({"choice": []}, "non-empty list"),
    ({"json": {}, "regex": "a"}, "exactly one of"),
])
def test_bad_specs_say_what_is_wrong(spec, says):
    assert says in check(spec)
    with pytest.raises(ValueError, match="structured_output"):
        SamplingParams(structured_output=spec)


# ---- grammars that fail: refused where it can be decided, else the request's own error -------

CYCLE = {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}
# Decidable without the model: what every answer must start with already fails.
FAILING_SPECS = {
    "repetition": ({"regex": "a{1000000}"}, "llguidance cannot follow the grammar: lexer error: too many expressions"),
    "nested repetition": ({"regex": "(a{1000}){1000}"}, "lexer error: too many expressions constructed"),
    "lark repetition": ({"grammar": 'start: "a"~1000000'}, "parser error: Too many items"),
    "$ref cycle": ({"json": {"$defs": CYCLE, "$ref": "#/$defs/a"}}, "the grammar admits no answer (llguidance: NoExtension"),
    "$ref to itself": ({"json": {"$ref": "#"}}, "the grammar admits no answer (llguidance: NoExtension"),
    "required $ref cycle": ({"json": {"$defs": CYCLE, "type": "object", "properties": {"x": {"$ref": "#/$defs/a"}},
                                      "required": ["x"]}},
                            """the grammar admits no answer that starts with '{"x":' (llguidance: NoExtension"""),
    "lark cycle": ({"grammar": "start: a\na: b\nb: a"}, "the grammar admits no answer (llguidance: NoExtension"),
    "lark cycle after a literal": ({"grammar": 'start: "x" a\na: b\nb: a'},
                                   "the grammar admits no answer that starts with 'x' (llguidance"),
}
# Fails only on some answers (the model's choice decides), or names the model's own tokens:
# accepted at submit; the engine reports what happens.
LIMIT_ON_ONE_BRANCH = {"regex": "b|a{1000000}"}
CYCLE_ON_ONE_BRANCH = {"grammar": 'start: "x" | "y" a\na: b\nb: a'}


@pytest.mark.parametrize("name", FAILING_SPECS)
def test_a_grammar_that_admits_no_answer_or_that_llguidance_cannot_follow_is_refused(name):
    spec, says = FAILING_SPECS[name]
    problem = check(spec)
    assert problem is not None and says in problem, problem
    assert "\n" not in problem and "<state>" not in problem
    with pytest.raises(ValueError, match="structured_output: .*" + re.escape(says[-20:])):
        SamplingParams(structured_output=spec)


@pytest.mark.parametrize("spec", [
    LIMIT_ON_ONE_BRANCH, CYCLE_ON_ONE_BRANCH,
    {"regex": "a{10000}"},                                         # long, but within llguidance's limits
    {"grammar": 'start: "a" <|im_end|>'},                          # a token of the model's (no byte of text)
    {"json": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}, "y": {"type": "integer"}},
              "required": ["y"], "$defs": CYCLE}},                 # the cycle is optional
    {"choice": ["yes"]},
])
def test_a_grammar_that_only_some_answers_fail_is_accepted(spec):
    assert check(spec) is None


@pytest.fixture(scope="module", params=[False, True], ids=["steps", "overlapped-steps"])
def tiny_engine(request, tiny_model_dir):
    return Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), num_kv_blocks=512, block_size=16,
                               max_num_batched_tokens=64, max_num_seqs=32, overlap_steps=request.param))


def test_a_grammar_that_fails_while_decoding_ends_its_own_request_as_an_error(tiny_engine):
    """logit_bias steers each failing request onto the branch that fails: "a" in b|a{1000000}
    (llguidance's lexer gives up on the token after it), "y" in "x" | "y" <cycle> (the mask
    after it has nothing, so it allows only end-of-sequence). Each ends `error` with
    llguidance's reason, each choice of an n = 2 request alike, while its neighbours in the
    same steps get exactly the tokens they get alone."""
    a, y = tiny_engine.tokenizer.convert_tokens_to_ids(["a", "y"])
    neighbours = [constrained(0), constrained(1), free(0)]
    alone = {out.id: out for out in tiny_engine.generate(neighbours)}
    failing = [
        Request("limit", prompt="Say a", params=SamplingParams(temperature=0, max_tokens=8, logit_bias={a: 100},
                                                               structured_output=LIMIT_ON_ONE_BRANCH)),
        Request("dead-end", prompt="Say y", params=SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=8,
                                                                  logit_bias={y: 100},
                                                                  structured_output=CYCLE_ON_ONE_BRANCH)),
    ]
    outs = {(out.id, out.choice): out for out in tiny_engine.generate([failing[0], *neighbours, failing[1]])}
    limit = outs["limit", 0]
    assert (limit.finish_reason, limit.valid, limit.text, limit.token_ids[0]) == ("error", False, "a", a)
    assert limit.error == ("structured output: llguidance cannot follow the grammar after 'a': "
                           "lexer error: too many expressions constructed")
    for choice in (0, 1):
        dead = outs["dead-end", choice]
        assert (dead.finish_reason, dead.valid, dead.text, dead.token_ids[0]) == ("error", False, "y", y)
        assert dead.error.startswith("structured output: the grammar admits no answer that starts with 'y' "
                                     "(llguidance: NoExtension"), dead.error
    for rid, before in alone.items():
        after = outs[rid, 0]
        assert (after.token_ids, after.finish_reason, after.valid, after.error) == (
            before.token_ids, before.finish_reason, before.valid, None), rid
        assert after.finish_reason in ("stop", "length")


def test_the_choices_of_an_n_request_each_follow_their_own_copy_of_the_grammar(tiny_engine):
    choices = {"choice": ["yes", "no", "maybe", "perhaps", "never"]}
    outs = list(tiny_engine.generate([Request("n", prompt="Well?", params=SamplingParams(
        temperature=1.5, seed=5, n=6, max_tokens=8, structured_output=choices))]))
    assert sorted(out.choice for out in outs) == list(range(6))
    assert all(out.finish_reason == "stop" and out.valid and out.text in choices["choice"] for out in outs)
    assert len({out.text for out in outs}) > 1   # each choice samples its own answer


# ---- the compile caches: bounded in bytes ---------------------------------------------------

def test_the_compile_caches_hold_a_bounded_number_of_bytes_least_recently_used_first():
    from pipeline import structured_output

    cache = structured_output._ByteBoundedCache(lambda key: key.upper(), max_bytes=10_000)
    keys = [f"{i:04d}" + "x" * 996 for i in range(30)]   # about 2 KB per entry: key and value
    for key in keys[:4]:
        cache(key)
    cache(keys[0])                                        # used again: now the most recent
    for key in keys[4:6]:
        cache(key)
    assert cache.bytes <= 10_000 and (cache.hits, cache.misses) == (1, 6)
    assert keys[0] in cache._entries and keys[1] not in cache._entries   # the least recently used went
    cache("y" * 20_000)                                   # larger than the whole budget: not kept
    assert "y" * 20_000 not in cache._entries and cache.bytes <= 10_000

    # The real ones: a few hundred distinct 137 KB schemas (the issue's worker went from 2.6 to
    # 4.6 GB with them) leave the grammar cache within its budget, the newest still cached.
    grammars = structured_output._grammar
    grammars.cache_clear()
    schemas = [{"type": "object", "description": f"{i} " + "d" * 137_000} for i in range(400)]
    for schema in schemas:
        structured_output.grammar_of({"json": schema})
    assert grammars.bytes <= grammars.max_bytes == 32 << 20
    assert 50 < len(grammars) < 400
    before = grammars.hits
    structured_output.grammar_of({"json": schemas[-1]})
    assert grammars.hits == before + 1
