"""Per-request sampling: greedy, temperature, top-k, top-p, min-p, repetition penalty, seeds.

Greedy rows are an argmax over the batch. Other rows are filtered together, then each
draws with its own torch.Generator when it has a seed, so a seeded request gives the
same text whatever else shares its batch.
"""
from __future__ import annotations

import torch

from pipeline.sequence import Sequence


class Sampler:
    def __init__(self, device: torch.device, seed: int | None = None):
        self.device = device
        # Unseeded requests share one generator.
        self.generator = torch.Generator(device=device)
        if seed is None:
            self.generator.seed()  # non-deterministic; torch.seed() would reseed the global RNG
        else:
            self.generator.manual_seed(seed)

    @torch.inference_mode()  # the logits are inference tensors; the penalty edits them in place
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits: [len(seqs), vocab] float32 -> one token id per sequence."""
        self._apply_repetition_penalty(logits, seqs)
        greedy = [i for i, s in enumerate(seqs) if s.params.is_greedy]
        sampled = [i for i, s in enumerate(seqs) if not s.params.is_greedy]
        tokens = [0] * len(seqs)
        if greedy:
            rows = logits if len(greedy) == len(seqs) else logits[greedy]
            # max(dim).indices: the first maximum, like argmax, but ~3x faster on CPU.
            for i, t in zip(greedy, rows.max(dim=-1).indices.tolist()):
                tokens[i] = t
        if sampled:
            probs = self._filtered_probs(logits[sampled], [seqs[i].params for i in sampled])
            for row, i in enumerate(sampled):
                gen = self._generator_of(seqs[i])
                tokens[i] = int(torch.multinomial(probs[row], 1, generator=gen))
        return tokens

    def _generator_of(self, seq: Sequence) -> torch.Generator:
        if seq.params.seed is None:
            return self.generator
        if seq.generator is None:
            seq.generator = torch.Generator(device=self.device)
            seq.generator.manual_seed(seq.params.seed)
        return seq.generator

    @staticmethod
    def _apply_repetition_penalty(logits: torch.Tensor, seqs: list[Sequence]) -> None:
        # CTRL-style: seen tokens get their logit divided (if > 0) or multiplied by the penalty.
        for row, seq in enumerate(seqs):
            penalty = seq.params.repetition_penalty
            if penalty == 1.0:
                continue
            seen = torch.tensor(sorted(set(seq.prompt_token_ids) | set(seq.output_token_ids)),
                                device=logits.device)
            values = logits[row, seen]
            logits[row, seen] = torch.where(values > 0, values / penalty, values * penalty)

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, params: list) -> torch.Tensor:
        """logits: [rows, vocab] -> probabilities after temperature, top-k, top-p, min-p."""
        device = logits.device
        temperature = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
        logits = logits / temperature
        vocab = logits.shape[-1]
        top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        if any(k < vocab for k in top_ks):
            k_max = max(top_ks)
            kth = logits.topk(k_max, dim=-1).values                      # [rows, k_max] sorted
            idx = torch.tensor(top_ks, device=device).unsqueeze(1) - 1
            logits = logits.masked_fill(logits < kth.gather(1, idx), float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        top_ps = torch.tensor([p.top_p for p in params], device=device).unsqueeze(1)
        if (top_ps < 1.0).any():
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_ps
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
        min_ps = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
        if (min_ps > 0).any():
            probs = probs.masked_fill(probs < min_ps * probs.max(dim=-1, keepdim=True).values, 0.0)
        return probs / probs.sum(dim=-1, keepdim=True)
