"""The engine's side of structured outputs: a matcher per constrained sequence, each step's masks.

The specs and their grammars are pipeline.structured_output; here llguidance's matchers
turn them into a bitmask per row, computed on the host, unpacked on the device and
applied as -inf to the rows of constrained sequences only.

llguidance never raises for a grammar that fails: its matcher enters an error state, at
creation, in a mask (whose only token is then end-of-sequence) or on a token it consumes
(a lexer or parser limit). The engine reads that state after each token and ends that
request alone with finish_reason "error" and `failure`'s message.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from pipeline.structured_output import failure as grammar_failure
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
        if device.type != "cpu":   # to unpack the bitmask on the device: each token's word and bit
            self._words = torch.arange(vocab_size, device=device) >> 5
            self._shifts = (torch.arange(vocab_size, device=device) & 31).to(torch.int32)

    def matcher(self, spec: dict):
        """A fresh matcher for spec; ValueError if the grammar cannot be built."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self._llg_tokenizer(), grammar_of(spec), log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured output: {grammar_failure(matcher.get_error())}")
        return matcher

    @staticmethod
    def failure(matcher, text: str) -> str:
        """The error of a request whose matcher failed while it decoded: llguidance's reason,
        after `text`, the answer the grammar had accepted."""
        return f"structured output: {grammar_failure(matcher.get_error(), text)}"

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
            # The masks are computed between forward passes, while the cores are free.
            self._executor = LLExecutor(num_threads=min(8, os.cpu_count() or 1))
        words = (self.vocab_size + 31) // 32
        if self._bitmask is None or self._bitmask.shape[0] < len(rows):
            self._bitmask = torch.empty((max(len(rows), 64), words), dtype=torch.int32,
                                        pin_memory=self.device.type == "cuda")
        bitmask = self._bitmask[:len(rows)]
        fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        if self.device.type == "cpu":   # numpy's unpackbits: one C pass, far cheaper than a gather
            bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
            disallowed = torch.from_numpy(bits[:, :self.vocab_size] == 0)            # [n, vocab]
        else:
            packed = bitmask.to(self.device, non_blocking=True)                       # [n, words]
            disallowed = ((packed[:, self._words] >> self._shifts) & 1) == 0          # [n, vocab]
        index = torch.tensor(rows, device=self.device)
        constrained = logits.index_select(0, index)
        logits.index_copy_(0, index, constrained.masked_fill_(disallowed, float("-inf")))
