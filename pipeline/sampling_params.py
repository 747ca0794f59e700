"""Per-request generation settings."""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_TOP_LOGPROBS = 20


@dataclass(slots=True)
class SamplingParams:
    """How one request is decoded. temperature == 0 means greedy.

    top_k <= 0, top_p == 1 and min_p == 0 disable those filters. A seed makes sampling
    reproducible whatever else shares the batch (each request has its own generator).

    This is the one declaration of the sampling settings: a job's requests take these fields
    by name, with their defaults (all but the engine's own, stop_token_ids and prompt_logprobs).
    A new option is a field here with its check below, its input check where jobs read it, and
    the sampler's code.
    """
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    # OpenAI's: subtracted from a token's logit, per time it occurs in the output so far
    # (frequency) and once if it occurs at all (presence); -2..2, 0 is off.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # token id -> added to its logit (-100..100: -100 bans it, +100 all but forces it).
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # One of {"json": schema}, {"json_object": True}, {"regex": ...}, {"choice": [...]},
    # {"grammar": lark}: the answer must follow it (pipeline.structured_output).
    structured_output: dict | None = None
    # Return each output token's logprob and this many top alternatives (0..20); None: none.
    # They are the log-softmax of the logits after penalties, logit bias and the grammar
    # mask, before temperature and the top-k/top-p/min-p filters: the model's distribution.
    logprobs: int | None = None
    # Independent answers to the same prompt (OpenAI's n): the prompt is computed once and its
    # KV blocks shared by the n sequences; a seed gives each choice its own reproducible stream.
    n: int = 1
    # Each prompt token's logprob (after the first, which nothing predicts) and this many top
    # alternatives (0..20), from the logits of the position before it; None: none. A request
    # that asks computes its whole prompt (the prefix cache cannot give logits back).
    prompt_logprobs: int | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.logit_bias:   # keys may come as strings (JSON, OpenAI's own form)
            self.logit_bias = {int(token): float(bias) for token, bias in self.logit_bias.items()}
            if any(token < 0 for token in self.logit_bias) or any(abs(b) > 100 for b in self.logit_bias.values()):
                raise ValueError("logit_bias maps token ids >= 0 to biases in [-100, 100]")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {value}")
        if self.structured_output is not None:
            from pipeline.structured_output import check

            if (problem := check(self.structured_output)) is not None:
                raise ValueError(f"structured_output: {problem}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether a token's logit depends on the tokens before it (or a fixed bias moves it):
        such rows are penalised in the sampler and never drafted."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or bool(self.logit_bias))

    @property
    def is_plain(self) -> bool:
        """Whether a token can be drafted and verified without looking at the tokens before
        it or reporting anything per token: no penalty, no bias, no logprobs."""
        return not self.has_penalties and self.logprobs is None
