"""Incremental detokenisation and stop strings.

Decoding a whole output after every token is quadratic; decoding token by token
breaks multi-byte characters and drops leading spaces. As in vLLM, decode a short
window twice (with and without the newest tokens) and emit the difference, holding
text back while it ends in an incomplete character. Without stop strings nobody reads
the text before the end, so it is decoded once, in flush().

A fast tokenizer's own streaming decoder (tokenizers' DecodeStream, in Rust) does the same
per token in one call: 1.3 us a token against 17.7 for the two Python-side decodes,
measured on the bundled model's tokenizer (benchmarks/host_step.py, 256 sequences: a stop
string's cost over greedy 3.2-3.8 -> 1.5-2.2 ms a step). The windows are kept either way:
flush() emits what is held back with them, and a slow tokenizer uses them for every token.
"""
from __future__ import annotations

try:
    from tokenizers.decoders import DecodeStream
except ImportError:   # tokenizers before 0.21
    DecodeStream = None

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # prompt tokens kept as context so the first word keeps its space


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str]):
        self.tokenizer = tokenizer
        self.tokens = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.text = ""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = (DecodeStream(self.tokens, skip_special_tokens=True)
                        if stop and backend is not None and DecodeStream is not None else None)
        self._backend = backend

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _emit(self, force: bool) -> str:
        prefix_text = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.tokens[self.prefix_offset:])
        if len(full_text) > len(prefix_text) and (force or not full_text.endswith(REPLACEMENT_CHAR)):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
            return full_text[len(prefix_text):]
        return ""

    def _step(self, token_id: int) -> str:
        """The streaming decoder's text for the newest token ("" while it holds a partial
        character), the windows moved as _emit moves them so that flush() can take over."""
        delta = self._stream.step(self._backend, token_id)
        if not delta:
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return delta

    def add_token(self, token_id: int) -> bool:
        """Append one output token; returns True when a stop string appeared
        (the text is then cut just before it)."""
        self.tokens.append(token_id)
        if not self.stop:
            return False      # decoded once, in flush()
        delta = self._emit(force=False) if self._stream is None else self._step(token_id)
        if not delta:
            return False
        self.text += delta
        return self._cut_at_stop(len(delta))

    def flush(self) -> bool:
        """At the end, emit what was held back (an incomplete character stays as U+FFFD);
        returns True when that completed a stop string (the text is then cut before it)."""
        delta = self._emit(force=True)
        if not delta:
            return False
        self.text += delta
        return self._cut_at_stop(len(delta))

    def _cut_at_stop(self, delta_len: int) -> bool:
        if not self.stop:
            return False
        # Only the new text and the tail a stop string could straddle need searching.
        start = max(0, len(self.text) - delta_len - self.max_stop_len + 1)
        found = [i for i in (self.text.find(s, start) for s in self.stop) if i != -1]
        if not found:
            return False
        self.text = self.text[:min(found)]
        return True
