"""The engine's side of structured outputs: a matcher per constrained sequence, each step's masks.

The specs and their grammars are pipeline.structured_output; here llguidance's matchers
turn them into a bitmask per row, computed on the host, unpacked on the device and
applied as -inf to the rows of constrained sequences only.
"""
from __future__ import annotations

import os

import torch

from pipeline.structured_output import grammar_of


class StructuredOutputs:
    """The engine's side: a matcher for each constrained sequence, and each step's masks.

    The tokenizer conversion (about a second) and the mask buffer are made on first use,
    so an engine that never sees a constrained request pays nothing.
    """

    def __init__(self, hf_tokenizer, vocab_size: int, device: torch.device):
        self.hf_tokenizer, self.vocab_size, self.device = hf_tokenizer, vocab_size, device
        self._tokenizer = None
        self._executor = None
        self._bitmask: torch.Tensor | None = None   # [rows, ceil(vocab / 32)] int32, on the host
        self._words = torch.arange(vocab_size, device=device) >> 5   # the word of each token's bit
        self._shifts = (torch.arange(vocab_size, device=device) & 31).to(torch.int32)

    def matcher(self, spec: dict):
        """A fresh matcher for spec; ValueError if the grammar cannot be built."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self._llg_tokenizer(), grammar_of(spec), log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured output: {matcher.get_error()}")
        return matcher

    def _llg_tokenizer(self):
        if self._tokenizer is None:
            import llguidance.hf

            self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size)
        return self._tokenizer

    @torch.inference_mode()
    def mask(self, logits: torch.Tensor, rows: list[int], matchers: list) -> None:
        """Set -inf in logits[row] on every token matchers[i] does not allow next (rows[i])."""
        if not rows:
            return
        from llguidance import LLExecutor
        from llguidance.torch import fill_next_token_bitmask_par

        if self._executor is None:
            # On a CPU the forward pass has the cores; a constrained batch's masks take one.
            self._executor = LLExecutor(num_threads=1 if self.device.type == "cpu" else min(8, os.cpu_count() or 1))
        words = (self.vocab_size + 31) // 32
        if self._bitmask is None or self._bitmask.shape[0] < len(rows):
            self._bitmask = torch.empty((max(len(rows), 64), words), dtype=torch.int32,
                                        pin_memory=self.device.type == "cuda")
        bitmask = self._bitmask[:len(rows)]
        fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        packed = bitmask.to(self.device, non_blocking=True)                       # [n, words]
        allowed = (packed[:, self._words] >> self._shifts) & 1                      # [n, vocab]
        index = torch.tensor(rows, device=self.device)
        constrained = logits.index_select(0, index)
        logits.index_copy_(0, index, constrained.masked_fill_(allowed == 0, float("-inf")))
