"""From sampled tokens to results: each token appended to its sequence (or put in its pending
place, overlapped), the stop checks (grammar, stop tokens, stop strings, lengths), and a
finished sequence retired, in one place (`_retire`), with its RequestOutput: its text (a
thinking model's chat answer split from its reasoning: pipeline.reasoning), and its
logprobs as token ids, texts and floats (pipeline.request.TokenLogprob; jobs.results makes
OpenAI's entries of them)."""
from __future__ import annotations

import json

from pipeline.engine.detokenizer import IncrementalDetokenizer
from pipeline.engine.scheduler import Scheduler
from pipeline.engine.sequence import Sequence
from pipeline.layers.grammar_masks import StructuredOutputs
from pipeline.models.loader import read_hf_config
from pipeline.reasoning import ThinkTags
from pipeline.request import FinishReason, RequestOutput, TokenLogprob
from pipeline.sampling_params import SamplingParams


class OutputProcessor:
    """Every way a sequence's tokens arrive (append, resolve), and every way it ends (those,
    pooled, time_out), for one engine."""

    def __init__(self, tokenizer, scheduler: Scheduler, eos_token_ids: set[int]):
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.eos_token_ids = eos_token_ids
        self._token_texts: dict[int, str] = {}   # logprobs: each token's text
        self.think = ThinkTags.of(tokenizer)      # None: the model does not think, answers stay whole

    def think_opened(self, chat: bool, prompt_ids: list[int]) -> bool | None:
        """Sequence.think_opened of a request: whether its prompt left a think block open,
        for a chat request on a thinking model; else None (its answer is not split)."""
        return self.think.opened_by(prompt_ids) if chat and self.think is not None else None

    def detokenizer(self, prompt_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop)

    def append(self, seq: Sequence, tokens: list[int], now: float) -> RequestOutput | None:
        """A step's sampled tokens for seq (one; up to 1 + K verified ones with drafts), up to
        the first that ends it: its result then, else None."""
        if seq.first_token_time is None:
            seq.first_token_time = now
        output = seq.output_token_ids
        for token in tokens:
            output.append(token)
            if self._ends(seq, token, len(output)):
                return self._retire(seq, now)
        if seq.draft_token_ids:
            self.scheduler.discard_rejected(seq)
        return None

    def resolve(self, seq: Sequence, token: int, now: float) -> RequestOutput | None:
        """An overlapped step's token, read back, in seq's oldest pending place: its result
        when it ends seq (the pending token after it, if the step in flight computes one, is
        then dropped), else None."""
        if seq.first_token_time is None:
            seq.first_token_time = now
        if not self._ends(seq, token, seq.fill_pending(token)):
            return None
        seq.drop_pending()
        self.scheduler.block_manager.cache_computed_blocks(seq)   # its last blocks' tokens are known now
        return self._retire(seq, now)

    def pooled(self, seqs: list[Sequence], vectors: list[list[float]], now: float) -> list[RequestOutput]:
        """The embedding sequences whose prompt a step completed, with their vectors."""
        outputs = []
        for seq, vector in zip(seqs, vectors):
            seq.finish_reason = FinishReason.STOP
            seq.first_token_time = now
            outputs.append(self._retire(seq, now, embedding=vector))
        return outputs

    def time_out(self, now: float) -> list[RequestOutput]:
        """End the sequences that ran past their timeout_s, keeping what they generated."""
        expired = [seq for seq in self.scheduler.unfinished() if seq.is_timed_out(now)]
        for seq in expired:
            seq.drop_pending()   # its tokens in flight
            seq.detokenizer.flush()
            seq.finish_reason = FinishReason.TIMEOUT
            if seq.matcher is not None:
                seq.valid = False   # cut short by its timeout
        # A first choice that timed out before its prompt was computed never forked the others.
        for seq in list(expired):
            for choice in range(1, seq.num_forks + 1):
                child = seq.fork(choice, self.detokenizer(seq.prompt_token_ids, seq.params))
                child.finish_reason, child.valid = seq.finish_reason, seq.valid
                expired.append(child)
        return [self._retire(seq, now, error=f"timed out after {seq.timeout_s:g} s") for seq in expired]

    def _retire(self, seq: Sequence, now: float, error: str | None = None,
                embedding: list[float] | None = None) -> RequestOutput:
        """seq, its finish_reason set, leaves the engine (its blocks freed): its result."""
        seq.finish_time = now
        self.scheduler.finish(seq)
        matcher = seq.matcher
        if error is None and seq.finish_reason is FinishReason.ERROR and matcher is not None and matcher.is_error():
            error = StructuredOutputs.failure(matcher, seq.detokenizer.text)   # its grammar failed (_ends)
        scored = embedding is None
        text, reasoning, reasoning_tokens = seq.detokenizer.text, None, None
        if seq.think_opened is not None and scored:
            reasoning, text, reasoning_tokens = self.think.split(text, seq.output_token_ids, seq.think_opened)
        return RequestOutput(
            id=seq.request_id, text=text, token_ids=list(seq.output_token_ids),
            finish_reason=seq.finish_reason, error=error, prompt_tokens=seq.num_prompt_tokens,
            output_tokens=seq.num_output_tokens, queue_s=seq.first_scheduled_time - seq.arrival_time,
            ttft_s=None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time,
            latency_s=seq.finish_time - seq.arrival_time, cached_tokens=seq.num_cached_tokens or 0,
            draft_tokens=seq.num_draft_tokens, accepted_tokens=seq.num_accepted_tokens, valid=seq.valid,
            logprobs=self._logprobs(seq) if scored else None,
            prompt_logprobs=self._prompt_logprobs(seq) if scored else None, choice=seq.choice, embedding=embedding,
            reasoning=reasoning, reasoning_tokens=reasoning_tokens)

    def _ends(self, seq: Sequence, token: int, num_output: int) -> bool:
        """Take seq's newest output token (its num_output-th, already in place): the grammar
        and the detokenizer see it; returns True when it finishes the sequence."""
        params = seq.params
        matcher = seq.matcher
        if matcher is not None:
            matcher.consume_token(token)   # the mask allowed it; an error shows in is_error()
            if matcher.is_error():
                # llguidance failed on this token (a lexer or parser limit) or in the mask before
                # it (nothing could follow: the mask allowed only end-of-sequence): this request
                # ends as an error (_retire takes the message from the matcher), its text what
                # the grammar had accepted.
                seq.detokenizer.flush()
                seq.finish_reason, seq.valid = FinishReason.ERROR, False
                return True
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            seq.finish_reason = FinishReason.STOP
        elif seq.detokenizer.add_token(token):
            seq.finish_reason = FinishReason.STOP
            if matcher is not None:
                seq.valid = False   # cut before a stop string
            return True  # the text is already cut before the stop string
        elif matcher is not None and matcher.is_stopped():   # the grammar allows nothing more
            seq.finish_reason = FinishReason.STOP
        elif num_output >= params.max_tokens or len(seq.prompt_token_ids) + num_output >= self.scheduler.max_model_len:
            seq.finish_reason = FinishReason.LENGTH
        else:
            return False
        cut = seq.detokenizer.flush()   # held-back text completed a stop string
        if cut:
            seq.finish_reason = FinishReason.STOP
        if matcher is not None:
            seq.valid = not cut and matcher.is_accepting() and not matcher.is_error()
        return True

    def _logprobs(self, seq: Sequence) -> list[TokenLogprob] | None:
        if seq.logprobs is None:
            return None
        return [self._scored(*entry) for entry in seq.logprobs[:seq.num_output_tokens]]

    def _prompt_logprobs(self, seq: Sequence) -> list[TokenLogprob] | None:
        scored = seq.prompt_logprobs
        if scored is None:
            return None
        first = seq.prompt_token_ids[0]   # nothing before it scores it
        return [TokenLogprob(first, self.token_text(first), None), *(self._scored(*entry) for entry in scored.entries)]

    def _scored(self, token_id: int, logprob: float, top: list[tuple[int, float]]) -> TokenLogprob:
        text = self.token_text
        return TokenLogprob(token_id, text(token_id), logprob, tuple(TokenLogprob(t, text(t), lp) for t, lp in top))

    def token_text(self, token_id: int) -> str:
        """The token decoded alone."""
        text = self._token_texts.get(token_id)
        if text is None:   # each token id decoded once per engine (the vocabulary bounds it)
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text


def eos_token_ids(model_dir, tokenizer) -> set[int]:
    """The tokens that end a sequence unless it ignores them (SamplingParams.ignore_eos): the
    model's config's, its generation config's and the tokenizer's."""
    ids = set()
    gen_config = model_dir / "generation_config.json"
    for source in (read_hf_config(model_dir), json.loads(gen_config.read_text()) if gen_config.exists() else {}):
        eos = source.get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
