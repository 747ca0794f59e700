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

A grammar can also fail while an answer is produced: llguidance gives up on a lexer or
parser beyond its limits (`a{1000000}`), or finds that nothing can come next (a `$ref`
cycle, Lark rules that only name each other). `check` finds at submit what it can decide
without the model: besides llguidance's own validation, it runs a matcher over a byte-level
vocabulary through the text every answer must begin with (the forced bytes). What only a
model's choice reaches fails that request alone, at decode time: its own error row, never a
`stop` (pipeline.layers.grammar_masks). The compile caches are bounded in bytes.
"""
from __future__ import annotations

import json
import re
import sys
import threading
from collections import OrderedDict

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# Lark-compatible regex syntax: everything but the characters that mean something in it.
_REGEX_SPECIAL = set(r".^$*+?()[]{}|\/")
# The forced bytes the submit-time probe follows at most: more than the prefix a schema or
# grammar forces in practice.
_PROBE_BYTES = 4096
# llguidance writes a token the grammar names (<|im_end|>, <[5]>) into forced bytes after 0xFF,
# a byte UTF-8 text never holds; the probe's byte vocabulary has no such tokens.
_TOKEN_MARK = b"\xff"
_ADMITS_NONE = "the grammar admits no answer"
_REFERENCE = re.compile(r'"\$(?:ref|recursiveRef|dynamicRef)"')   # a key of a JSON schema, in its canonical JSON


class _ByteBoundedCache:
    """A function of one string, memoised least-recently-used within max_bytes of keys and
    values (sys.getsizeof), not a number of entries: specs range from a few bytes to
    megabytes, so a count bound holds anything from kilobytes to gigabytes. Thread-safe (the
    API validates in threads); like functools.lru_cache, an exception is not cached."""

    def __init__(self, function, max_bytes: int):
        self._function, self.max_bytes = function, max_bytes
        self._entries: OrderedDict[str, tuple[object, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = self.hits = self.misses = 0

    def __call__(self, key: str):
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return entry[0]
            self.misses += 1
        value = self._function(key)   # outside the lock: a slow compile blocks no other spec
        size = sys.getsizeof(key) + sys.getsizeof(value)
        with self._lock:
            if size <= self.max_bytes and key not in self._entries:
                self._entries[key] = (value, size)
                self.bytes += size
                while self.bytes > self.max_bytes:
                    _, (_, evicted) = self._entries.popitem(last=False)
                    self.bytes -= evicted
        return value

    def __len__(self) -> int:
        return len(self._entries)

    def cache_clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = self.hits = self.misses = 0


# Each compile cache holds at most 32 MiB (64 MiB together): thousands of the usual few-KB
# schemas, so a job's specs stay compiled, or about a hundred of 137 KB; a miss costs one
# compile again (milliseconds; a submit's check, up to a few tenths of a second for the
# largest), while a worker's memory no longer grows with every distinct large spec it meets
# (bounded at 4096 entries, 137 KB schemas could hold over a gigabyte).
_CACHE_BYTES = 32 << 20


def canonical(spec: dict) -> str:
    """The spec as compact JSON: the key of the compile caches. Key order is kept (not
    sorted): a schema's property order is the order the answer's fields come in."""
    return json.dumps(spec, separators=(",", ":"), ensure_ascii=False)


def check(spec) -> str | None:
    """What is wrong with a structured-output spec (a bad shape, an invalid JSON schema, a
    regex that does not compile, an unsupported schema feature, a grammar that admits no
    answer or that llguidance cannot follow from its start), or None. Cached per spec."""
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in KINDS:
        return f"must be an object with exactly one of {', '.join(KINDS)}"
    try:
        return _check(canonical(spec))
    except (TypeError, ValueError) as e:
        return str(e)


def _check_uncached(key: str) -> str | None:
    from llguidance import LLMatcher

    try:
        grammar = _grammar(key)
    except (TypeError, ValueError) as e:
        return str(e)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        return _one_line(messages[0])
    (kind, value), = json.loads(key).items()
    if kind != "json":
        return _probe(grammar)
    # llguidance's schema compiler reports an unsatisfiable schema itself ("Unsatisfiable
    # schema: ...", above), except through a $ref cycle, which it cannot resolve then: only a
    # schema with a reference is probed (a large schema's probe costs a few tenths of a second).
    if not _REFERENCE.search(key):
        return None
    # Its grammar lets whitespace in between fields, so its answers share no forced start past
    # "{". Without that whitespace it admits the same values: when it admits none (a cycle at
    # the top or under required properties), neither does the schema. Other errors there are
    # the compact grammar's own (an endless forced nesting, which the schema's grammar follows
    # until max_tokens, meets a parser limit): only "no answer" counts.
    compact = LLMatcher.grammar_from_json_schema(value, overrides={"whitespace_flexible": False})
    return _probe(compact, empty_only=True)


_check = _ByteBoundedCache(_check_uncached, _CACHE_BYTES)


def _probe(grammar: str, empty_only: bool = False) -> str | None:
    """Why llguidance fails on the start every answer of a valid grammar has, or None: a
    matcher over a byte vocabulary computes the first step's mask, takes the bytes it forces
    one at a time and computes the mask after them. An error there is one every answer would
    meet. A grammar that names the model's own tokens is left to the engine, which has them.
    empty_only: only an error that says nothing can follow counts (the grammar admits no answer)."""
    from llguidance import LLMatcher, LLParserLimits

    matcher = LLMatcher(_byte_tokenizer(), grammar, log_level=0, limits=LLParserLimits(verbose_errors=False))
    if matcher.is_error():   # validation passed: only a named token the byte vocabulary lacks
        return None
    matcher.compute_bitmask()
    taken = bytearray()
    if not matcher.is_error():
        for byte in matcher.compute_ff_bytes()[:_PROBE_BYTES].split(_TOKEN_MARK)[0]:
            if not matcher.consume_token(byte):
                break
            taken.append(byte)
        else:
            if taken:
                matcher.compute_bitmask()
    if not matcher.is_error():
        return None
    problem = failure(matcher.get_error(), taken.decode("utf-8", "replace"))
    return None if empty_only and not problem.startswith(_ADMITS_NONE) else problem


def failure(message: str, prefix: str = "") -> str:
    """llguidance's error of a matcher (get_error()) as the one line a result or a line error
    shows: a grammar with nothing allowed next says it admits no answer (that starts with
    `prefix`, the text it had reached), a limit of llguidance's lexer or parser says so."""
    reason = _one_line(message)
    shown = repr(prefix if len(prefix) <= 40 else prefix[:40] + "...") if prefix else ""
    if reason.startswith("NoExtension"):   # llguidance's stop reason: no byte may come next
        return f"{_ADMITS_NONE}{' that starts with ' + shown if shown else ''} (llguidance: {reason})"
    return f"llguidance cannot follow the grammar{' after ' + shown if shown else ''}: {reason}"


_BYTE_TOKENIZER = None


def _byte_tokenizer():
    """An llguidance vocabulary of the 256 bytes and an end-of-sequence token: a matcher without
    a model's tokenizer (made in a millisecond)."""
    global _BYTE_TOKENIZER
    if _BYTE_TOKENIZER is None:
        from llguidance import LLTokenizer, TokenizerWrapper

        class Bytes:
            eos_token_id, bos_token_id = 256, None
            tokens = [bytes([b]) for b in range(256)] + [b"</s>"]
            special_token_ids = [256]

            def __call__(self, text):
                return list(text if isinstance(text, bytes) else text.encode("utf-8"))

        _BYTE_TOKENIZER = LLTokenizer(TokenizerWrapper(Bytes()))
    return _BYTE_TOKENIZER


def _one_line(message: str) -> str:
    """llguidance's message without its source excerpt and caret lines, nor the parser state a
    matcher's error appends (<state> ... or <non-verbose/>), on one line."""
    message = re.split(r"\n<(?:state>|non-verbose/>)", message, maxsplit=1)[0]
    kept = [line.strip() for line in message.splitlines()
            if line.strip() and not set(line.strip()) <= {"^", " "} and not re.match(r"\s*\d+ \|", line)]
    return " ".join(kept)


def grammar_of(spec: dict) -> str:
    """The llguidance grammar of a spec (compiled once per distinct spec)."""
    return _grammar(canonical(spec))


def _grammar_uncached(key: str) -> str:
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


_grammar = _ByteBoundedCache(_grammar_uncached, _CACHE_BYTES)


def _escape(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_SPECIAL else c for c in text)
