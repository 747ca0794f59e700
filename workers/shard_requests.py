"""The engine requests of a shard's lines (jobs.input.request_spec.RequestSpec ->
pipeline.request.Request): a line's sampling settings by SamplingParams' field names, one
engine request per prompt of a several-prompt line, one per input of an embedding line."""
from __future__ import annotations

from operator import attrgetter

from jobs.input.line_checks import RequestSpec
from jobs.input.request_spec import SAMPLING_FIELDS
from pipeline.pooling_params import PoolingParams
from pipeline.request import Request
from pipeline.sampling_params import SamplingParams


def to_request(spec: RequestSpec, timeout_s: float | None = None) -> Request:
    """The engine request of a shard line (timeout_s: the job's, for a line without its
    own); ValueError if the engine rejects its settings."""
    return _request(spec, spec.id, {"prompt": spec.prompt, "messages": spec.messages}, timeout_s)


def prompt_requests(spec: RequestSpec, timeout_s: float | None = None) -> list[Request]:
    """The engine requests of a line with several prompts: one per prompt (a text or token
    ids), n answers each, with ids as embedding_requests' (the spec's id, a NUL, the index)."""
    return [_request(spec, f"{spec.id}\0{i}", {"prompt": item} if isinstance(item, str) else {"prompt_token_ids": item},
                     timeout_s) for i, item in enumerate(spec.prompts)]


# Every sampling setting a shard line carries: SamplingParams' fields but request_spec.ENGINE_ONLY,
# read at once (in C: this runs for every line of every shard).
_SAMPLING_NAMES = tuple(f.name for f in SAMPLING_FIELDS)
_sampling_values = attrgetter(*_SAMPLING_NAMES)


def _request(spec: RequestSpec, request_id: str, prompt: dict, timeout_s: float | None) -> Request:
    params = SamplingParams(**dict(zip(_SAMPLING_NAMES, _sampling_values(spec))),
                            prompt_logprobs=spec.logprobs if spec.echo else None)   # echo: the prompt's too
    return Request(request_id, **prompt, params=params, timeout_s=spec.timeout_s or timeout_s, tools=spec.tools,
                   reasoning_effort=spec.reasoning_effort)


def embedding_requests(spec: RequestSpec, timeout_s: float | None = None) -> list[Request]:
    """The engine requests of an embedding line: one per input (a text or token ids), with
    ids unique in the shard: the spec's id, a NUL, the input's index (the digits after the
    last NUL, so two (id, index) pairs never give one id)."""
    pooling = PoolingParams(spec.dimensions)
    timeout_s = spec.timeout_s or timeout_s
    return [Request(f"{spec.id}\0{i}", **({"prompt": item} if isinstance(item, str) else {"prompt_token_ids": item}),
                    pooling=pooling, timeout_s=timeout_s) for i, item in enumerate(spec.input)]
