"""Speculative decoding: draft tokens cheaply, verify them all in one forward pass.

Prompt lookup (n-gram) drafting: a sequence whose last n tokens also occur earlier in
its own prompt or output proposes the K tokens that followed that earlier occurrence
(the latest one; the longest n first). No draft model: it wins exactly where a batch job
copies from its input (extraction, rewriting, quoting summaries, code edits).

Each step the scheduler gives a decoding sequence its last sampled token plus its drafts
(1 + K tokens); the model runner lays them out as 1 + K decode rows over the sequence's
blocks, so they join the same continuous batch as every other decode and prefill chunk.
Verification then reads 1 + K rows of logits:
- greedy: the drafts are kept up to the first one that differs from the argmax, then the
  argmax there (or, all accepted, the bonus token after the last draft): exactly the
  tokens plain decoding would give;
- sampled: standard rejection sampling. The drafts are a point mass q = 1 at the drafted
  token d, so d is accepted with probability p(d); at the first rejection the token is
  drawn from the residual max(p - q, 0) (p without d, renormalised), and after K
  acceptances from the next position's p. That draws from p exactly, as plain sampling does.
  Seeded requests take every random number from their own generator (still reproducible).
The caller then rolls the KV cache back past the rejected drafts (Scheduler.discard_rejected).

Requests with a penalty, a logit bias or logprobs are never drafted (logprobs would have to
be reported for the accepted drafts too): their distribution at each
draft position would depend on the drafts before it (the bias is not applied on the
verification paths either); nor are structured-output requests (their
grammar's mask at each draft position would too).
"""
from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from pipeline.layers import top_tokens
from pipeline.layers.sampler import Sampler
from pipeline.engine.sequence import Sequence


class NgramProposer:
    """The K tokens after the latest earlier occurrence of the sequence's last n tokens,
    trying n = max_n down to min_n."""

    def __init__(self, max_n: int = 3, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n

    def propose(self, token_ids: np.ndarray, k: int) -> list[int]:
        length = len(token_ids)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # Windows starting at 0 .. length-n-1: each has at least one token after it.
            windows = sliding_window_view(token_ids[:-1], n)
            hits = np.flatnonzero((windows == token_ids[-n:]).all(axis=1))
            if len(hits):
                start = hits[-1] + n
                return token_ids[start:start + k].tolist()
        return []


class Speculator:
    """Proposes drafts for the running sequences and turns a step's logits into each
    sequence's new tokens (one without drafts, up to 1 + K with)."""

    def __init__(self, method: str, num_speculative_tokens: int, sampler: Sampler):
        self.sampler = sampler
        self.proposer = NgramProposer() if method == "ngram" else None
        self.num_speculative_tokens = num_speculative_tokens

    def propose(self, running: list[Sequence]) -> None:
        """Set draft_token_ids on every running sequence (empty unless it is decoding)."""
        if self.proposer is None:
            return
        for seq in running:
            seq.draft_token_ids = []
        for seq in (s for s in running if s.num_uncomputed_tokens == 1):
            # Drafts past max_tokens are never used: the last new token is the verified one.
            k = min(self.num_speculative_tokens, seq.params.max_tokens - seq.num_output_tokens - 1)
            if k > 0 and seq.params.is_plain and seq.matcher is None:
                seq.draft_token_ids = self.proposer.propose(seq.all_token_ids(), k)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[list[int]]:
        """logits: one row per sequence, 1 + len(draft_token_ids) rows for a drafted one,
        in order -> each sequence's new tokens."""
        if not any(s.draft_token_ids for s in seqs):
            return [[t] for t in self.sampler(logits, seqs)]
        rows, start = [], 0
        for seq in seqs:
            rows.append((start, start + 1 + len(seq.draft_token_ids)))
            start = rows[-1][1]
        plain = [i for i, s in enumerate(seqs) if not s.draft_token_ids]
        out: list[list[int]] = [[] for _ in seqs]
        if plain:
            index = torch.tensor([rows[i][0] for i in plain], device=logits.device)
            for i, token in zip(plain, self.sampler(logits.index_select(0, index), [seqs[i] for i in plain])):
                out[i] = [token]
        greedy = [i for i, s in enumerate(seqs) if s.draft_token_ids and s.params.is_greedy]
        if greedy:
            index = torch.cat([torch.arange(*rows[i], device=logits.device) for i in greedy])
            targets = top_tokens.argmax(logits.index_select(0, index)).tolist()   # one transfer
            at = 0
            for i in greedy:
                n = rows[i][1] - rows[i][0]
                out[i] = _accept_greedy(seqs[i].draft_token_ids, targets[at:at + n])
                at += n
        for i, seq in enumerate(seqs):
            if seq.draft_token_ids and not seq.params.is_greedy:
                out[i] = self._rejection_sample(logits[rows[i][0]:rows[i][1]], seq)
        for seq, tokens in zip(seqs, out):
            if seq.draft_token_ids:
                seq.num_draft_tokens += len(seq.draft_token_ids)
                seq.num_accepted_tokens += len(tokens) - 1
        return out

    def _rejection_sample(self, logits: torch.Tensor, seq: Sequence) -> list[int]:
        drafts = seq.draft_token_ids
        k = len(drafts)
        generator = self.sampler.generator_for(seq)
        probs = Sampler._filtered_probs(logits, [seq.params] * (k + 1))              # [k + 1, vocab]
        draft_index = torch.tensor(drafts, device=logits.device)
        p_draft = probs[torch.arange(k, device=logits.device), draft_index]           # [k]
        uniform = torch.rand(k, generator=generator, device=logits.device)
        # Every row's fallback at once: the residual (p without the draft) at rows < k,
        # the bonus distribution at row k; an exponential race draws from unnormalised weights.
        residual = probs.clone()
        residual[torch.arange(k, device=logits.device), draft_index] = 0.0
        noise = torch.empty_like(residual).exponential_(generator=generator).clamp_min_(torch.finfo(residual.dtype).tiny)
        drawn = top_tokens.argmax(residual.div_(noise))                               # [k + 1]
        values = torch.cat([(uniform < p_draft).long(), drawn]).tolist()              # one transfer
        accepted, fallback = values[:k], values[k:]
        j = next((i for i, ok in enumerate(accepted) if not ok), k)
        return drafts[:j] + [fallback[j]]


def _accept_greedy(drafts: list[int], targets: list[int]) -> list[int]:
    """targets: the argmax after the last real token and after each draft (len(drafts) + 1)."""
    j = next((i for i, (d, t) in enumerate(zip(drafts, targets)) if d != t), len(drafts))
    return targets[:j + 1]
