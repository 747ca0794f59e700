"""One input line read as JSON, strictly: UTF-8 (a byte-order mark before the first line
allowed), no NaN or Infinity, no key given twice in one object, nesting within a limit, and
one object (a request) a line. Each refusal raises Bad with the message the user reads for
that line (jobs.input.line_checks numbers it).
"""
from __future__ import annotations

import json

from jobs.input.field_checks import Bad, describe

_BOM = b"\xef\xbb\xbf"


def _reject_constant(name: str):
    raise ValueError(f"{name} is not allowed (numbers must be finite)")


def _object(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object, refusing a key given twice (a plain dict would keep the last silently)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        duplicate = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"the key {duplicate!r} appears twice in one object")
    return obj


DECODER = json.JSONDecoder(parse_constant=_reject_constant, object_pairs_hook=_object)


def too_deep(value, limit: int) -> bool:
    """Whether containers nest more than `limit` levels; iterative, so deep input cannot recurse."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > limit:
                return True
            stack.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))
    return False


def parse_line(number: int, raw: bytes, max_depth: int) -> dict:
    """Line `number` of an input file (its bytes, without the newline) as the JSON object it holds."""
    if number == 1 and raw.startswith(_BOM):
        raw = raw[len(_BOM):]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Bad(f"the line is not valid UTF-8 (bad byte at offset {e.start})") from None
    obj = parse_json(text, max_depth)
    if not isinstance(obj, dict):
        raise Bad(f"expected a JSON object (one request), got {describe(obj)}")
    return obj


def parse_json(text: str, max_depth: int):
    """One JSON value, read as strictly as a line (a Parquet table's body given as a JSON string too)."""
    try:
        obj = DECODER.decode(text)
    except RecursionError:
        raise Bad(f"the JSON is nested too deeply (the limit is {max_depth} levels)") from None
    except json.JSONDecodeError as e:
        if "\r" in text:
            raise Bad("invalid JSON: the line holds a carriage return (\\r) not followed by a newline; the "
                      "file's lines seem to end with CR alone (old Mac style): end them with \\n or \\r\\n") from None
        raise Bad(f"invalid JSON: {e.msg} at column {e.colno}") from None
    except ValueError as e:  # NaN/Infinity, or an integer with too many digits
        raise Bad(f"invalid JSON: {e}") from None
    # Bracket count bounds the depth: the full walk is only needed for bracket-heavy lines.
    brackets = text.count("[") + text.count("{")
    if brackets > max_depth and too_deep(obj, max_depth):
        raise Bad(f"the JSON is nested too deeply (the limit is {max_depth} levels)")
    return obj
