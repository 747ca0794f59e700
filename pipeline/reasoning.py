"""Reasoning models: `reasoning_effort` given to the chat template, and an answer split into
its think block and what follows it. No torch.

A chat template that thinks has the model write `<think>\\n...\\n</think>\\n\\nanswer`:
Qwen3's reads `enable_thinking` (false puts an empty, closed think block into the prompt);
DeepSeek-R1's opens `<think>\\n` in the prompt itself, so the output holds only
`...</think>answer`. The split is that of vLLM's reasoning parsers: what comes before
`</think>` is the reasoning, the rest the answer; a block never closed (max_tokens came
first) is all reasoning and the answer is empty. Reasoning is split only for chat requests
on a model whose template and vocabulary have the tags (ThinkTags.of); logprobs stay per
token, think tokens included.
"""
from __future__ import annotations

START, END = "<think>", "</think>"
# OpenAI's reasoning_effort values (openai.types.shared.ReasoningEffort). A template has a
# switch, not a budget: "none" turns thinking off, every other value on.
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def template_options(reasoning_effort: str | None) -> dict:
    """The chat template's keyword arguments for a request's reasoning_effort: enable_thinking
    (Qwen3's switch) and reasoning_effort itself (gpt-oss-style templates read it); a template
    reading neither ignores both, as vLLM does. None: the template's own default."""
    if reasoning_effort is None:
        return {}
    return {"enable_thinking": reasoning_effort != "none", "reasoning_effort": reasoning_effort}


class ThinkTags:
    """A thinking model's <think> and </think> token ids, and the split of its answers."""

    def __init__(self, tokenizer, start_id: int, end_id: int):
        self.tokenizer, self.start_id, self.end_id = tokenizer, start_id, end_id

    @classmethod
    def of(cls, tokenizer) -> "ThinkTags | None":
        """The tags when the model thinks: its chat template writes <think> and each tag is one
        token that decodes as itself (a tag hidden as a special token could not be found in
        the text); else None, and answers are left whole."""
        template = getattr(tokenizer, "chat_template", None) or ""
        sources = template.values() if isinstance(template, dict) else [template]
        if not any(START in source for source in sources):
            return None
        try:
            vocab = tokenizer.get_vocab()
            ids = vocab.get(START), vocab.get(END)
            if None in ids or any(tokenizer.decode([i], skip_special_tokens=True) != tag
                                  for i, tag in zip(ids, (START, END))):
                return None
        except Exception:   # a tokenizer without a vocabulary to look in: nothing to split
            return None
        return cls(tokenizer, *ids)

    def opened_by(self, prompt_ids: list[int]) -> bool:
        """Whether the prompt ends inside a think block (DeepSeek-R1's generation prompt opens
        one; Qwen3's with thinking off closes the one it opens)."""
        start, end = _last(prompt_ids, self.start_id), _last(prompt_ids, self.end_id)
        return start > end

    def split(self, text: str, token_ids: list[int], opened: bool) -> tuple[str | None, str, int]:
        """(reasoning, answer, reasoning tokens) of an output; opened: the prompt left a think
        block open. An output that opens no block is all answer (reasoning None, 0 tokens).
        Newlines around the reasoning and before the answer go, as Qwen3's template drops
        them when it renders an earlier turn."""
        stripped = text.lstrip()
        if stripped.startswith(START):   # the model opens it (Qwen3), or opens it again
            text = stripped[len(START):]
        elif not opened:
            return None, text, 0
        reasoning, closed, answer = text.partition(END)
        if not closed:
            return reasoning.strip("\n"), "", len(token_ids)
        if self.end_id in token_ids:   # up to and including the </think> token
            count = token_ids.index(self.end_id) + 1
        else:   # the tag spelled in pieces: what the answer's text does not take
            count = max(len(token_ids) - len(self.tokenizer.encode(answer, add_special_tokens=False)), 0)
        return reasoning.strip("\n"), answer.lstrip("\n"), count


def _last(ids: list[int], token: int) -> int:
    """The position of token's last occurrence in ids, -1 if none (searched in C)."""
    try:
        return len(ids) - 1 - ids[::-1].index(token)
    except ValueError:
        return -1
