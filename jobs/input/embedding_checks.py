"""The fields of an embedding request: OpenAI's /v1/embeddings body, or a pipeline-format
line with `input` instead of prompt or messages.

`input` is one text, a list of texts, one list of token ids, or a list of such lists, as
OpenAI takes it; a request with several inputs gets one vector (one result row) per input,
in order. Each check adds the user's message to `problems` and returns the normalised value.
"""
from __future__ import annotations

from jobs.input.prompt_checks import texts_or_token_ids
from jobs.input.field_checks import EMBEDDINGS_ENDPOINT, check, describe, int_in

__all__ = ["EMBEDDINGS_ENDPOINT", "embedding_inputs", "dimensions_setting", "encoding_format_setting"]
ENCODING_FORMATS = ("float", "base64")
# An OpenAI /v1/embeddings body's fields (user changes nothing about the answer: ignored).
OPENAI_EMBEDDING_KEYS = {"model", "input", "dimensions", "encoding_format", "user"}
# A pipeline-format embedding line's fields.
PIPELINE_EMBEDDING_KEYS = {"id", "input", "dimensions", "timeout_s"}


def embedding_inputs(value, max_chars: int, problems: list[str]) -> list | None:
    """The inputs of a request as a list: of texts, or of token-id lists."""
    return check(texts_or_token_ids, "input", value, max_chars, problems)


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
