"""A request's prompt as the engine tokenizes it: the one place that says how (the engines,
and `pipeline submit --dry-run`, which counts tokens before anything runs). No torch."""
from __future__ import annotations


def prompt_token_ids(tokenizer, *, prompt: str | None = None, messages: list[dict] | None = None,
                     tools: list[dict] | None = None, token_ids: list[int] | None = None) -> list[int]:
    """Token ids as given; chat messages through the tokenizer's chat template (with the
    assistant's turn opened, tools given to it); a raw prompt encoded with the tokenizer's
    special tokens (a BOS where the model has one)."""
    if token_ids is not None:
        return list(token_ids)
    if messages is not None:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(prompt)
