"""What goes into the engine and what comes out of it, one request at a time."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from pipeline.pooling_params import PoolingParams
from pipeline.sampling_params import SamplingParams


class FinishReason(str, Enum):
    """Why a request ended; str-valued, so results and the ledger store the plain word."""
    STOP = "stop"            # an end-of-sequence token, a stop token id or a stop string
    LENGTH = "length"        # max_tokens or the model's context length
    ERROR = "error"          # the request could not run (`error` says why)
    CANCELLED = "cancelled"  # dropped unfinished (job cancelled); written by the job side
    TIMEOUT = "timeout"      # still running after its timeout_s: its partial text is kept

    def __str__(self) -> str:
        return self.value

    @property
    def is_success(self) -> bool:
        return self in (FinishReason.STOP, FinishReason.LENGTH)

    @property
    def is_failure(self) -> bool:
        """The request ran (or tried to) and failed; it counts as failed and can be retried."""
        return self in (FinishReason.ERROR, FinishReason.TIMEOUT)


@dataclass(slots=True)
class Request:
    """One generation request: a raw `prompt`, chat `messages` (rendered with the
    tokenizer's chat template), or already tokenised `prompt_token_ids`. timeout_s: the
    longest it may run, from its first step (its wait for a place in the batch does not
    count); then it ends with finish_reason timeout, its partial text kept and its KV
    blocks freed.

    With `pooling`, the request asks for an embedding instead: its prompt is computed, its
    hidden states pooled into RequestOutput.embedding, and nothing is generated (params
    play no part but n, which must be 1)."""
    id: str
    prompt: str | None = None
    messages: list[dict] | None = None
    prompt_token_ids: list[int] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    timeout_s: float | None = None
    tools: list[dict] | None = None   # OpenAI function tools, given to the chat template with `messages`
    pooling: PoolingParams | None = None   # an embedding request
    # OpenAI's reasoning_effort, given to the chat template with `messages` ("none" turns a
    # thinking template's thinking off: pipeline.reasoning.template_options); None: its default.
    reasoning_effort: str | None = None

    def __post_init__(self):
        # (added up without a generator: every request is made twice, by its shard and by the engine loop)
        given = (self.prompt is not None) + (self.messages is not None) + (self.prompt_token_ids is not None)
        if given != 1:
            raise ValueError(f"request {self.id!r}: give exactly one of prompt, messages, prompt_token_ids")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"request {self.id!r}: timeout_s must be > 0, got {self.timeout_s}")


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A token and its logprob (RequestOutput.logprobs, prompt_logprobs): the token at a
    position, with `top` its most likely alternatives there, most likely first (as many as
    the request asked for, maybe none). text: the token decoded alone (only the engine has
    the tokenizer; jobs.results makes OpenAI's entries from it). A prompt's first token has
    neither logprob nor `top` (nothing comes before it); an alternative has no `top`."""
    token_id: int
    text: str
    logprob: float | None
    top: tuple[TokenLogprob, ...] | None = None


@dataclass(slots=True)
class RequestOutput:
    """A finished request (one choice of it, when params.n > 1): stop or length, timeout (with its partial text; `error` says
    so), or error (then `error` says why).

    cached_tokens: prompt tokens whose KV came from the prefix cache instead of being computed.
    draft_tokens, accepted_tokens: speculative decoding's proposed draft tokens and those
    verification accepted (0 without speculation); each step also adds one verified token.
    Times are seconds: queue_s from submission to first scheduled, ttft_s from submission to
    the first output token, latency_s from submission to finish.
    """
    id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    error: str | None
    prompt_tokens: int
    output_tokens: int
    queue_s: float
    ttft_s: float | None
    latency_s: float
    cached_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    # A structured-output request: whether its answer is complete under the grammar (a
    # stop string or max_tokens can cut it short); None for an unconstrained one.
    valid: bool | None = None
    # params.logprobs: one per output token; else None.
    logprobs: list[TokenLogprob] | None = None
    # params.prompt_logprobs: one per prompt token, the first without logprob or alternatives; else None.
    prompt_logprobs: list[TokenLogprob] | None = None
    # Which of the request's params.n answers this is (0 .. n - 1): each choice is its own output.
    choice: int = 0
    # An embedding request's vector (Request.pooling); None for generation.
    embedding: list[float] | None = None
    # A chat request on a model whose template thinks (pipeline.reasoning): the think
    # block's text (None: the output opened none; `text` is then the whole answer) and its
    # tokens, the tags included (None: not split, the model does not think).
    reasoning: str | None = None
    reasoning_tokens: int | None = None
