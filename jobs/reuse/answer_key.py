"""A request's key: a digest of everything that decides its answer, so that a later job can
take a stored answer instead of computing it again (jobs.reuse.stored_answers).

What goes in:
* the engine's fingerprint: the model by content (pipeline.models.fingerprint: weights,
  config, tokenizer and chat template, wherever the directory lies) and every engine option
  that changes answers (pipeline.engine_key.identity: dtype, quantization, KV-cache dtype,
  context length, speculative decoding);
* the request's shard line (RequestSpec.to_dict) without what does not change the answer:
  its id and line number, the model name it used, its timeout (only a success is stored)
  and an embedding's output encoding. The prompt is its text and messages (and tools)
  rather than its tokens: the fingerprint fixes the tokenizer and the chat template, which
  make the tokens from them, so the same text gives the same tokens. Every sampling and
  output setting is in the line, defaults left out, so a field added later with a default
  keeps the keys of older lines.
* the job's answer scope (jobs.ledger.api_keys.answer_scope): an API key's answers are
  reused for that key alone (or the keys sharing its scope by choice), so one team's batch
  never tells whether another ran the same prompt; CLI jobs share the local scope (none).
Only deterministic requests have a key: greedy (temperature 0), sampled with a seed, or an
embedding. Unseeded sampling has none: its point is to differ.
"""
from __future__ import annotations

import hashlib
import json

import msgspec

from pipeline.engine_key import identity
from pipeline.models.fingerprint import model_fingerprint
from pipeline.models.model_dir import readable_model_dir

NOT_IN_KEY = frozenset({"id", "line", "model", "timeout_s", "encoding_format", "key"})
_encode = msgspec.json.Encoder(order="sorted").encode   # compact UTF-8 JSON, keys sorted: one form per line


def engine_fingerprint(engine_options: dict) -> str | None:
    """The engine's identity with the model by content (32 hex digits); None when the model's
    files cannot be read here (a job for a directory only its workers have: nothing is keyed)."""
    ident = identity(engine_options)
    model_dir = readable_model_dir(ident.pop("model"))
    if model_dir is None:
        return None
    try:
        ident["model_files"] = model_fingerprint(model_dir)
    except OSError:
        return None
    return hashlib.blake2b(json.dumps(ident, sort_keys=True).encode(), digest_size=16).hexdigest()


def is_deterministic(line: dict) -> bool:
    """Whether a shard line's answer is the same every time it is computed."""
    return line.get("input") is not None or line["temperature"] == 0 or line["seed"] is not None


def request_key(line: dict, engine: str | None, scope: str | None = None) -> str | None:
    """The key of a shard line (RequestSpec.to_dict()) on the engine of that fingerprint, in
    an answer scope (None: the local one); None when its answer is not deterministic (or the
    engine has no fingerprint)."""
    if engine is None or not is_deterministic(line):
        return None
    body = line.copy()
    for name in NOT_IN_KEY:
        body.pop(name, None)
    scoped = engine.encode() if scope is None else engine.encode() + b"\0" + scope.encode() + b"\0"
    return hashlib.blake2b(scoped + _encode(body), digest_size=16).hexdigest()
