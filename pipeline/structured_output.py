"""Structured outputs: the grammar an answer must follow, applied as a token mask each step.

A request's `SamplingParams.structured_output` is a dict with exactly one key (vLLM's
names): {"json": schema}, {"json_object": true} (any JSON object), {"regex": pattern},
{"choice": [strings]} or {"grammar": lark}. llguidance (the grammar library vLLM, SGLang
and llama.cpp use) compiles it, once per distinct spec (`grammar_of` is cached by the
spec's canonical JSON), and a matcher per sequence follows the tokens it has produced.
Each step, only the rows of constrained sequences get -inf on every token the grammar
does not allow, before sampling: greedy, temperature, top-p/k, min-p, seeds and penalties
then choose among the allowed tokens exactly as they would among all.

How it composes with the rest of the engine: the matcher advances only on tokens that are
appended to the output, so chunked prefill, prefix caching and preemption by recompute
(which keeps the output tokens) leave it valid; constrained rows are never drafted by
speculative decoding (pipeline.engine.speculative skips them). An answer is `valid` when the
matcher accepts it at the end: a stop string or max_tokens that cut it short leave it
invalid, and the results say so. This module only defines the specs (no torch: job
validation uses it); the engine's masks are pipeline.layers.grammar_masks.
"""
from __future__ import annotations

import functools
import json
import re

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# Lark-compatible regex syntax: everything but the characters that mean something in it.
_REGEX_SPECIAL = set(r".^$*+?()[]{}|\/")


def canonical(spec: dict) -> str:
    """The spec as compact JSON: the key of the compile caches. Key order is kept (not
    sorted): a schema's property order is the order the answer's fields come in."""
    return json.dumps(spec, separators=(",", ":"), ensure_ascii=False)


def check(spec) -> str | None:
    """What is wrong with a structured-output spec (a bad shape, an invalid JSON schema, a
    regex that does not compile, an unsupported schema feature), or None. Cached per spec."""
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in KINDS:
        return f"must be an object with exactly one of {', '.join(KINDS)}"
    try:
        return _check(canonical(spec))
    except (TypeError, ValueError) as e:
        return str(e)


@functools.lru_cache(maxsize=4096)
def _check(key: str) -> str | None:
    from llguidance import LLMatcher

    try:
        grammar = _grammar(key)
    except (TypeError, ValueError) as e:
        return str(e)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    return _one_line(messages[0]) if is_error else None


def _one_line(message: str) -> str:
    """llguidance's message without its source excerpt and caret lines, on one line."""
    kept = [line.strip() for line in message.splitlines()
            if line.strip() and not set(line.strip()) <= {"^", " "} and not re.match(r"\s*\d+ \|", line)]
    return " ".join(kept)


def grammar_of(spec: dict) -> str:
    """The llguidance grammar of a spec (compiled once per distinct spec)."""
    return _grammar(canonical(spec))


@functools.lru_cache(maxsize=4096)
def _grammar(key: str) -> str:
    from llguidance import LLMatcher

    (kind, value), = json.loads(key).items()
    if kind == "json":
        if not isinstance(value, dict):
            raise ValueError("json must be a JSON schema (an object)")
        return LLMatcher.grammar_from_json_schema(value)
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"})
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise ValueError("regex must be a non-empty string")
        return LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        if (not isinstance(value, list) or not value
                or not all(isinstance(c, str) and c for c in value)):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        return LLMatcher.grammar_from_regex("|".join(_escape(c) for c in value))
    if not isinstance(value, str) or not value.strip():
        raise ValueError("grammar must be a non-empty Lark grammar")
    return LLMatcher.grammar_from_lark(value)


def _escape(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_SPECIAL else c for c in text)
