"""What goes into the engine and what comes out of it, one request at a time."""
from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.sampling_params import SamplingParams


@dataclass(slots=True)
class Request:
    """One generation request: a raw `prompt`, chat `messages` (rendered with the
    tokenizer's chat template), or already tokenised `prompt_token_ids`."""
    id: str
    prompt: str | None = None
    messages: list[dict] | None = None
    prompt_token_ids: list[int] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)

    def __post_init__(self):
        given = sum(x is not None for x in (self.prompt, self.messages, self.prompt_token_ids))
        if given != 1:
            raise ValueError(f"request {self.id!r}: give exactly one of prompt, messages, prompt_token_ids")


@dataclass(slots=True)
class RequestOutput:
    """A finished request. finish_reason is "stop", "length" or "error" (then `error` says why).

    Times are seconds: queue_s from submission to first scheduled, ttft_s from submission to
    the first output token, latency_s from submission to finish.
    """
    id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    error: str | None
    prompt_tokens: int
    output_tokens: int
    queue_s: float
    ttft_s: float | None
    latency_s: float
