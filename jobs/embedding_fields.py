"""The fields of an embedding request: OpenAI's /v1/embeddings body, or a pipeline-format
line with `input` instead of prompt or messages.

`input` is one text, a list of texts, one list of token ids, or a list of such lists, as
OpenAI takes it; a request with several inputs gets one vector (one result row) per input,
in order. Each check adds the user's message to `problems` and returns the normalised value.
"""
from __future__ import annotations

from jobs.request_fields import EMBEDDINGS_ENDPOINT, Bad, check, describe, int_in, string

__all__ = ["EMBEDDINGS_ENDPOINT", "embedding_inputs", "dimensions_setting", "encoding_format_setting"]
ENCODING_FORMATS = ("float", "base64")
MAX_INPUTS = 2048            # OpenAI's limit of inputs in one embeddings request
MAX_TOKEN_ID = 2**31 - 1
# An OpenAI /v1/embeddings body's fields (user changes nothing about the answer: ignored).
OPENAI_EMBEDDING_KEYS = {"model", "input", "dimensions", "encoding_format", "user"}
# A pipeline-format embedding line's fields.
PIPELINE_EMBEDDING_KEYS = {"id", "input", "dimensions", "timeout_s"}


def embedding_inputs(value, max_chars: int, problems: list[str]) -> list | None:
    """The inputs of a request as a list: of texts, or of token-id lists."""
    return check(_inputs, "input", value, max_chars, problems)


def _inputs(name, v, max_chars):
    if isinstance(v, str):
        return [string(name, v, max_chars)]
    if not isinstance(v, list) or not v:
        raise Bad(f"{name} must be a string, a list of strings or token ids, got {describe(v)}")
    if len(v) > MAX_INPUTS:
        raise Bad(f"{name} has {len(v)} items; at most {MAX_INPUTS} are allowed (split it over several lines)")
    if all(type(x) is int for x in v):   # one input given as token ids
        return [_token_ids(name, v)]
    if all(isinstance(x, str) for x in v):
        items = [string(f"{name}[{i}]", x, max_chars) for i, x in enumerate(v)]
        total = sum(map(len, items))
        if total > max_chars:
            raise Bad(f"{name} has {total} characters in all; the limit is {max_chars}")
        return items
    if all(isinstance(x, list) for x in v):
        return [_token_ids(f"{name}[{i}]", x) for i, x in enumerate(v)]
    raise Bad(f"{name} must be all strings, all token ids or all lists of token ids, not a mix")


def _token_ids(name, v):
    if not v:
        raise Bad(f"{name} is an empty list of token ids")
    for i, t in enumerate(v):
        if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID:
            raise Bad(f"{name}[{i}] must be a token id (an integer >= 0), got {describe(t)}")
    return list(v)


def dimensions_setting(value, problems: list[str]) -> int | None:
    return None if value is None else check(int_in(1, 65536), "dimensions", value, None, problems)


def encoding_format_setting(value, problems: list[str]) -> str | None:
    """None for floats (the default), "base64" for float32 bytes in base64 (OpenAI's two)."""
    if value is None or value == "float":
        return None
    if value not in ENCODING_FORMATS:
        problems.append(f"encoding_format must be \"float\" or \"base64\", got {describe(value)}")
        return None
    return value
