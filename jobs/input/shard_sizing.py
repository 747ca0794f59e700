"""How many lines a new job's shards hold when the submitter leaves it to us (`--shard-size auto`).

A shard costs a fixed 26-33 ms of one thread wherever it runs, whatever its size: its claim,
its Parquet file written and synced, its ledger commit, the finalizer's check
(docs/performance.md#short-requests). 256 generation lines are seconds of work, beside which
that vanishes; 256 one-token classification or embedding lines are tens of ms, and it about
doubles them. So `auto` sizes a job's shards by their work: about AUTO_SHARD_TOKENS prompt and
output tokens a shard, MIN_LINES to MAX_LINES lines, estimated from the file's first lines.
A job keeps about MIN_SHARDS shards or more (its line count is estimated from its size),
so that a small job still spreads over many workers (eight GPUs' workers holding eight
shards each).
It is one number for the whole job, as a given --shard-size is: the ledger keeps it and a
retry reuses it. Nothing here judges a line: one that does not parse weighs nothing, and the
validation that follows reports it.
"""
from __future__ import annotations

import math
import os

import msgspec

from jobs.input.file_reading import open_regular_file
from jobs.input.request_source import is_parquet
from jobs.input.request_spec import SAMPLING_FIELDS

AUTO = "auto"
MIN_LINES, MAX_LINES = 256, 2048   # 256: the fixed size's default; 2,048 ran as fast as 4,096 on 20,000 lines
AUTO_SHARD_TOKENS = 256 * 256      # 256 lines of a 256-token prompt and answer
MIN_SHARDS = 64
SAMPLE_LINES, SAMPLE_BYTES = 1000, 4 << 20
MOST_OUTPUT, MOST_CHOICES = 1_000_000, 128   # what validation allows (a bad line's huge number stays finite)
DEFAULT_MAX_TOKENS = next(f.default for f in SAMPLING_FIELDS if f.name == "max_tokens")   # a line that gives none
EMBEDDINGS_URL = "/v1/embeddings"

_decode = msgspec.json.decode
_encode = msgspec.json.encode


def resolve_shard_size(shard_size: int | str, path) -> int:
    """shard_size itself, or for AUTO the lines a shard of the file at path should hold:
    AUTO_SHARD_TOKENS over its first lines' mean estimated tokens, within MIN_LINES..MAX_LINES,
    and no more than leaves the file MIN_SHARDS shards (MIN_LINES for a Parquet table or a
    file whose start says nothing)."""
    if isinstance(shard_size, str):
        if shard_size != AUTO:
            raise ValueError(f'a shard size is "{AUTO}" or a whole number, not {shard_size!r}')
        return _auto(path)
    return shard_size


def _auto(path) -> int:
    weights, sampled_bytes = sample_weights(path)
    if not weights:
        return MIN_LINES
    by_work = AUTO_SHARD_TOKENS / (sum(weights) / len(weights))
    lines = len(weights) * os.path.getsize(path) / max(sampled_bytes, 1)   # the file's, estimated
    return int(max(MIN_LINES, min(MAX_LINES, by_work, math.ceil(lines / MIN_SHARDS))))


def sample_weights(path) -> tuple[list[int], int]:
    """The estimated tokens (line_weight) of the file's first lines that parse, up to
    SAMPLE_LINES of its first SAMPLE_BYTES, and the bytes those lines took; none for a
    Parquet table or what is not a regular file."""
    try:
        f, _ = open_regular_file(path)
    except OSError:   # (the validation says what is wrong with it)
        return [], 0
    if f is None:
        return [], 0
    with f:
        if is_parquet(path, f):
            return [], 0
        head = f.read(SAMPLE_BYTES)
    lines = head.split(b"\n")
    if len(head) == SAMPLE_BYTES:
        lines.pop()   # cut short
    weights, read = [], 0
    for line in lines[:SAMPLE_LINES]:
        read += len(line) + 1
        if line.strip():
            try:
                weight = line_weight(_decode(line.removeprefix(b"\xef\xbb\xbf")))
            except Exception:   # not JSON, nested past the parser's depth: the validation reports it
                continue
            if weight is not None:
                weights.append(weight)
    return weights, read


def line_weight(line) -> int | None:
    """A line's prompt and output tokens, roughly: the JSON bytes of what it sends the model
    (prompt or messages, tools, a response format; a Responses body's instructions and input)
    over 4, about a token of English text (of a token id list, one or two an id); plus its
    output, max_tokens (max_completion_tokens, max_output_tokens; else the default) times n
    for each of its prompts. An embedding's inputs alone. Either format (an OpenAI line's body,
    by its url). None: not a request."""
    openai = isinstance(line, dict) and isinstance(line.get("body"), dict)
    body = line["body"] if openai else line
    if not isinstance(body, dict):
        return None
    if (line.get("url") == EMBEDDINGS_URL) if openai else body.get("input") is not None:
        return 1 + len(_encode(body.get("input"))) // 4
    sent = [body.get(k) for k in ("prompt", "messages", "instructions", "input", "tools", "response_format",
                                  "structured_outputs", "text")]
    prompts = body.get("prompt")
    several = isinstance(prompts, list) and prompts and isinstance(prompts[0], (str, list))
    asked = body.get("max_completion_tokens") or body.get("max_output_tokens") or body.get("max_tokens")
    output = min(asked, MOST_OUTPUT) if isinstance(asked, int) and asked > 0 else DEFAULT_MAX_TOKENS
    n = min(body.get("n"), MOST_CHOICES) if isinstance(body.get("n"), int) and body.get("n") > 0 else 1
    return 1 + len(_encode([v for v in sent if v is not None])) // 4 + output * n * (len(prompts) if several else 1)
