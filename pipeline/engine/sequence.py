"""A request's state while the engine works on it."""
from __future__ import annotations

import hashlib
from enum import Enum, auto

import numpy as np

from pipeline.engine import clock
from pipeline.engine.detokenizer import IncrementalDetokenizer
from pipeline.request import FinishReason
from pipeline.sampling_params import SamplingParams

# Overlapped steps (step_in_flight.py): an output token sampled on the device and not read back yet.
# Negative, so that a forward fed one by mistake fails at its embedding instead of running.
PENDING_TOKEN = -1


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class PromptLogprobs:
    """A request's prompt logprobs as they are computed, chunk by chunk: `entries` (token id,
    logprob, [(top id, logprob), ...]) for prompt positions 1 .. next_position, the last ones
    possibly still on the device in `pending` (flat tensors the sampler brings back with its
    one transfer). Shared by the forks of an n > 1 request: their prompt is the same."""

    def __init__(self, num_top: int):
        self.num_top = num_top
        self.next_position = 0   # the next prompt position whose logits are wanted (it scores the token after it)
        self.entries: list[tuple[int, float, list[tuple[int, float]]]] = []
        self.pending: list[tuple] = []   # (flat device tensor, tokens scored, top alternatives in it)


class Sequence:
    """Tokens of one request plus how far the KV cache has caught up with them.

    There are no separate prefill and decode phases: each step computes some of the
    tokens not yet in the cache (`num_computed_tokens` < `num_tokens`). A prompt is
    caught up in chunks; a decoding sequence is one token behind. Preemption
    (recompute) simply resets `num_computed_tokens` to 0.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 detokenizer: IncrementalDetokenizer, arrival_time: float | None = None,
                 timeout_s: float | None = None, pooling=None):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.params = params
        self.detokenizer = detokenizer
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.table_row: int | None = None   # its row in the block manager's BlockTableRows, while it holds blocks
        # Prefix caching (block_manager): hashes of the full blocks of its tokens, and how
        # many of its leading blocks are already registered in the cache.
        self.block_hashes: list[bytes] = []
        self.num_registered_blocks = 0
        self.num_cached_tokens: int | None = None   # prompt tokens found cached at first admission
        self.num_preemptions = 0
        # Speculative decoding (speculative.py): tokens proposed to verify this step (not
        # part of the sequence until accepted), and totals over the request's life.
        self.draft_token_ids: list[int] = []
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.finish_reason: FinishReason | None = None
        self.arrival_time = arrival_time if arrival_time is not None else clock.now()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.timeout_s = timeout_s   # from first_scheduled_time (see Request)
        self.generator = None  # a torch.Generator when params.seed is set (see sampler)
        # n > 1 (params.n): which answer this sequence is, and how many more the first one
        # forks once its prompt is computed (Engine: they share its KV blocks).
        self.choice = 0
        self.num_forks = params.n - 1
        # A chat request on a thinking model (pipeline.reasoning.ThinkTags): whether its prompt
        # left a think block open; None: its answer is not split.
        self.think_opened: bool | None = None
        # Structured output (pipeline.structured_output): the grammar's matcher, advanced by
        # every output token; whether the answer was complete under it, once finished.
        self.matcher = None
        self.valid: bool | None = None
        # params.logprobs: one (token id, logprob, [(top id, logprob), ...]) per output token.
        self.logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = (
            [] if params.logprobs is not None else None)
        self.prompt_logprobs = PromptLogprobs(params.prompt_logprobs) if params.prompt_logprobs is not None else None
        # An embedding request (pipeline.pooling_params.PoolingParams): prefill only, its
        # hidden states pooled (layers/pooler.py keeps the partial vector in `pooled`).
        self.pooling = pooling
        self.pooled = None
        self.reads_every_position = False   # its pooling needs every prompt position's hidden state
        # Overlapped steps (step_in_flight.py): whether they may run it (nothing on the host reads its
        # newest token before the next forward), how many PENDING_TOKENs end its output (1, or
        # 2 while the step after the one that sampled them is in flight), and the row of the
        # newest among its step's sampled tokens, which the next forward takes as its input.
        self.overlaps = False
        self.num_pending_tokens = 0
        self.pending_row = 0

    @property
    def seed(self) -> int | None:
        """The seed of this choice's random stream: the request's for the first, one derived
        from it for each other (so choices differ, and each is reproducible)."""
        seed = self.params.seed
        if seed is None or self.choice == 0:
            return seed
        digest = hashlib.blake2b(f"{seed}/{self.choice}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 1   # torch takes seeds below 2**63

    def fork(self, choice: int, detokenizer: IncrementalDetokenizer) -> "Sequence":
        """Choice `choice` of the same request, at the point this one's prompt is computed
        (no output yet); it holds no blocks until the scheduler shares them."""
        child = Sequence(self.request_id, self.prompt_token_ids, self.params, detokenizer,
                         self.arrival_time, self.timeout_s)
        child.choice, child.num_forks = choice, 0
        child.prompt_logprobs = self.prompt_logprobs
        child.think_opened = self.think_opened
        child.first_scheduled_time = self.first_scheduled_time
        return child

    def is_timed_out(self, now: float) -> bool:
        return (self.timeout_s is not None and self.first_scheduled_time is not None
                and now - self.first_scheduled_time >= self.timeout_s)

    @property
    def wants_prompt_logits(self) -> bool:
        """Whether some prompt position's logits are still to be computed (params.prompt_logprobs)."""
        return self.prompt_logprobs is not None and self.prompt_logprobs.next_position < self.num_prompt_tokens - 1

    @property
    def uses_prefix_cache(self) -> bool:
        """Whether its prompt may start from cached blocks: not when every position's logits
        (prompt logprobs) or hidden state (mean or cls pooling) must be computed."""
        return not (self.wants_prompt_logits or self.reads_every_position)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Prompt + output tokens whose ids the host has (all but the pending ones)."""
        return self.num_tokens - self.num_pending_tokens

    @property
    def known_output_token_ids(self) -> list[int]:
        """The output tokens whose ids the host has."""
        out = self.output_token_ids
        return out[:len(out) - self.num_pending_tokens] if self.num_pending_tokens else out

    def add_pending(self, count: int = 1) -> None:
        """Hold places for `count` output tokens sampled on the device (overlapped steps)."""
        self.output_token_ids.extend([PENDING_TOKEN] * count)
        self.num_pending_tokens += count

    def fill_pending(self, token: int) -> int:
        """Put a sampled token in the oldest pending place; returns how many output tokens the
        host now has up to it."""
        output = self.output_token_ids
        self.num_pending_tokens -= 1
        known = len(output) - self.num_pending_tokens
        output[known - 1] = token
        return known

    def drop_pending(self) -> int:
        """Forget the pending output tokens; returns how many there were."""
        count = self.num_pending_tokens
        if count:
            del self.output_token_ids[-count:]
            self.num_pending_tokens = 0
        return count

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_id(self, i: int) -> int:
        """Token i of prompt + output."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without copying the whole sequence."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    def all_token_ids(self) -> np.ndarray:
        """Prompt + output as an int64 array (for the n-gram search)."""
        return np.fromiter((*self.prompt_token_ids, *self.output_token_ids), dtype=np.int64,
                           count=self.num_tokens)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
