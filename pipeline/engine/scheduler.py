"""Continuous batching: decides which tokens of which sequences run in the next step.

Torch-free. Every step gives each running sequence (oldest first) the tokens it still
needs, within the step's token budget, then admits waiting sequences while blocks,
budget and the sequence limit allow. A long prompt therefore runs in chunks beside
other sequences' decodes. When the KV cache runs out of blocks, the newest running
sequence is preempted: its blocks are freed and it is recomputed later from its tokens.

With prefix caching, a sequence being admitted first takes the cached blocks that hold
the longest prefix of its tokens and computes only the rest: the step's token budget
counts only uncached tokens (a preempted sequence may hit its own blocks again).

Speculative decoding: a decoding sequence with draft tokens (speculative.py) is given its
last token plus as many drafts as the budget and the model length allow; when the pool is
short its drafts are dropped before anyone is preempted. After verification,
`discard_rejected` rolls its length and blocks back to the tokens it kept.

Admission in groups (`admission_group` > 1, the default where CUDA graphs run): while
sequences decode, waiting ones are admitted only once that many slots are free (or all the
waiting fit), together. Admitting each as soon as one slot frees puts a prefill chunk
beside the decodes in nearly every step of a long job, and such a mixed step cannot replay
a decode graph. On a W1-shaped job of 2,048 requests at 256 sequences, 22% of steps were
plain decodes, and 91% in groups of 32, for 5.4% more steps (benchmarks/decode_share.py).

n > 1: a request's first sequence computes the prompt alone; once it is computed, `fork`
adds the other choices as running sequences sharing its blocks (as many as the sequence
limit allows; the rest wait at the head of the queue and are admitted like any sequence,
finding the prompt's full blocks in the prefix cache when it is on).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pipeline.engine.block_manager import BlockManager
from pipeline.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens each sequence computes this step

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, admission_group: int = 1):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.admission_group = admission_group   # free slots that admit new work while others decode
        self.context_len = max_model_len   # the model's (or the configured) context length
        # A sequence can never grow past what the whole cache holds; a request that could is
        # refused (admission_error), so this cuts only at the context length in practice.
        self.cache_tokens = block_manager.num_blocks * block_manager.block_size
        self.max_model_len = min(max_model_len, self.cache_tokens)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def admission_error(self, seq: Sequence) -> str | None:
        """Why `seq` can never run, or None: its prompt is empty or cannot fit the context,
        or the tokens it may reach cannot fit the whole KV cache (length_error)."""
        if seq.num_prompt_tokens == 0:
            return "the prompt is empty after tokenisation"
        return length_error(seq.num_prompt_tokens, seq.params.max_tokens, seq.pooling is not None,
                            self.context_len, self.cache_tokens)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> ScheduledBatch:
        seqs: list[Sequence] = []
        num_new_tokens: list[int] = []
        budget = self.max_num_batched_tokens
        preempted = False

        queue = deque(self.running)
        try_allocate = self.block_manager.try_allocate
        while queue and budget > 0:
            seq = queue.popleft()
            if seq.num_pending_tokens and seq.num_output_tokens >= seq.params.max_tokens:
                continue   # its pending token is its last (overlapped steps): nothing to compute
            n = min(seq.num_uncomputed_tokens, budget)
            if seq.draft_token_ids:
                del seq.draft_token_ids[max(0, min(budget - 1, self.max_model_len - seq.num_tokens)):]
                n += len(seq.draft_token_ids)
            while not try_allocate(seq, seq.num_computed_tokens + n):
                if seq.draft_token_ids:   # drafts are optional: drop them before preempting
                    n -= len(seq.draft_token_ids)
                    seq.draft_token_ids = []
                    continue
                preempted = True
                victim = queue.pop() if queue else seq  # the newest not yet scheduled
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                seqs.append(seq)
                num_new_tokens.append(n)
                budget -= n

        # Admit new work only when nothing had to be preempted: otherwise it would
        # take the blocks the preempted sequences are waiting for.
        if preempted or not self._admits_now():
            return ScheduledBatch(seqs, num_new_tokens)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # Prompt logprobs and mean pooling read every prompt position: nothing from the cache.
            cached = self.block_manager.find_cached_prefix(seq) if seq.uses_prefix_cache else []
            num_cached = len(cached) * self.block_manager.block_size
            n = min(seq.num_tokens - num_cached, budget)
            if not self.block_manager.try_allocate(seq, num_cached + n, cached):
                break
            self.waiting.popleft()
            seq.num_computed_tokens = num_cached
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = min(num_cached, seq.num_prompt_tokens)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            num_new_tokens.append(n)
            budget -= n
        return ScheduledBatch(seqs, num_new_tokens)

    def _admits_now(self) -> bool:
        """Whether waiting sequences may be admitted this step: once admission_group slots are
        free, or all that wait fit, or nothing runs."""
        free = self.max_num_seqs - len(self.running)
        return free >= min(self.admission_group, len(self.waiting)) or not self.running

    def fork(self, parent: Sequence, children: list[Sequence]) -> list[Sequence]:
        """Add parent's other choices (forks of it, with its prompt just computed); returns
        those that run from now on, sharing parent's blocks, and so sample in this step."""
        room = max(0, self.max_num_seqs - len(self.running))
        running, waiting = children[:room], children[room:]
        for child in running:
            self.block_manager.share(parent, child)
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = child.num_prompt_tokens   # none of its prompt was computed for it
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
        self.waiting.extendleft(reversed(waiting))
        return running

    def discard_rejected(self, seq: Sequence) -> None:
        """After a verified step: the cache holds seq's tokens up to its last new one (not
        yet computed), the rejected drafts' slots are dropped, blocks and all."""
        seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
        seq.draft_token_ids = []
        self.block_manager.truncate(seq, seq.num_computed_tokens)

    def _preempt(self, seq: Sequence) -> None:
        seq.draft_token_ids = []
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def unfinished(self) -> list[Sequence]:
        return [*self.running, *self.waiting]

    def finish(self, seq: Sequence) -> None:
        """Retire a sequence at once and return its blocks (finished or cancelled)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def abort(self, request_ids: set[str]) -> list[Sequence]:
        """Drop the unfinished sequences of these requests; returns them."""
        dropped = [s for s in self.unfinished() if s.request_id in request_ids]
        for seq in dropped:
            self.finish(seq)
        return dropped

    def abort_all(self) -> list[Sequence]:
        """Drop every unfinished sequence (cancellation); returns them."""
        dropped = self.unfinished()
        for seq in dropped:
            self.finish(seq)
        return dropped


def length_error(prompt_tokens: int, max_tokens: int, embedding: bool, context_len: int,
                 cache_tokens: int | None) -> str | None:
    """Why a prompt of prompt_tokens can never run, or None: it leaves no room for an output
    token in the context, or the tokens it may reach do not fit a KV cache of cache_tokens
    (None: not known; jobs.dry_run asks before an engine exists).

    The tokens it may reach are its prompt plus max_tokens, up to the context length (an
    embedding: its prompt and one more). Cut at the cache's size instead, an answer would end
    `length` where the model and the request allow more: a wrong answer that a larger cache
    would not give (the cache's size is in neither the engine key nor the answer's key),
    stored and reused as if complete. Refused, it is a failed row that `pipeline retry
    --only-failed` runs again on a larger cache. Choices of an n > 1 request share the
    prompt's blocks but each may grow alone: the same bound.
    """
    n = prompt_tokens
    if n >= context_len:
        return (f"the prompt has {n} tokens but the maximum model length is {context_len} "
                f"tokens (prompt plus at least one output token)")
    reach = n + 1 if embedding else min(n + max_tokens, context_len)
    if cache_tokens is not None and reach > cache_tokens:
        wants = "its prompt and one more token" if embedding else \
            f"{n} prompt tokens plus max_tokens {max_tokens}" + (
                f", up to the maximum model length of {context_len}" if reach == context_len else "")
        return (f"the request may need {reach} tokens of KV cache ({wants}) but the whole cache holds "
                f"{cache_tokens}; give the engine a larger KV cache (kv_cache_gib) or lower max_tokens")
    return None
