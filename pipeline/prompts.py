"""A request's prompt as the engine tokenizes it: the one place that says how (the engines,
and `pipeline submit --dry-run`, which counts tokens before anything runs). No torch."""
from __future__ import annotations

import functools
from collections.abc import Sequence
from types import SimpleNamespace

from pipeline.reasoning import template_options


def prompt_token_ids(tokenizer, *, prompt: str | None = None, messages: list[dict] | None = None,
                     tools: list[dict] | None = None, token_ids: list[int] | None = None,
                     reasoning_effort: str | None = None) -> list[int]:
    """One request's ids (prompts_token_ids); raises what fails it."""
    [ids] = prompts_token_ids(tokenizer, [SimpleNamespace(prompt=prompt, messages=messages, tools=tools,
                                                          prompt_token_ids=token_ids,
                                                          reasoning_effort=reasoning_effort)])
    if isinstance(ids, Exception):
        raise ids
    return ids


def prompts_token_ids(tokenizer, requests: Sequence) -> list[list[int] | Exception]:
    """Each request's ids (anything with prompt, messages, tools and prompt_token_ids; maybe
    reasoning_effort), or the exception that fails it alone: token ids as given; chat
    messages through the tokenizer's chat template (with the assistant's turn opened, tools
    and the thinking switch given to it: pipeline.reasoning.template_options; an
    assistant's tool_calls only where the template shows them); a raw
    prompt encoded with the tokenizer's special tokens (a BOS where the model has one).

    The texts go to the tokenizer in one call per kind (raw prompts, rendered chats): a
    fast tokenizer encodes a batch in Rust threads with the GIL released, where one text at
    a time holds the GIL and pays the wrapper's Python each time (a W1 prompt: 270 us
    alone, 230 in fours, 170 in sixteens on two cores). Likewise the chats without tools
    go through the chat template in one call per reasoning_effort (_rendered_together)."""
    ids: list[list[int] | Exception | None] = [None] * len(requests)
    raw, chats = [], []   # (index, text): encoded with special tokens, and without
    plain_chats: dict[str | None, list[int]] = {}   # reasoning_effort -> indexes of chats without tools
    for i, r in enumerate(requests):
        if r.prompt_token_ids is not None:
            ids[i] = list(r.prompt_token_ids)
        elif r.messages is not None:
            try:
                _check_template_shows_tool_calls(tokenizer, r.messages)
            except Exception as e:   # a bad message fails its request only
                ids[i] = e
                continue
            effort = getattr(r, "reasoning_effort", None)
            if r.tools is None and r.messages:   # (an empty chat is refused by the template called alone)
                plain_chats.setdefault(effort, []).append(i)
            else:
                chats.append(_rendered_or_error(tokenizer, i, r.messages, r.tools, effort, ids))
        else:
            raw.append((i, r.prompt))
    for effort, indexes in plain_chats.items():
        chats.extend(_rendered_together(tokenizer, indexes, [requests[i].messages for i in indexes], effort, ids))
    chats = [chat for chat in chats if chat is not None]
    for texts, special in ((raw, True), (chats, False)):
        if not texts:
            continue
        try:
            encoded = encoded_texts(tokenizer, [t for _, t in texts], special)
        except Exception:   # find the text that fails, one at a time
            encoded = [_encoded_or_error(tokenizer, t, special) for _, t in texts]
        for (i, _), e in zip(texts, encoded):
            ids[i] = e
    return ids


def encoded_texts(tokenizer, texts: list[str], special: bool) -> list[list[int]]:
    """tokenizer(texts, add_special_tokens=special)["input_ids"], the same ids. A fast
    tokenizer whose encoding is the library's own (_rust_backend) is called at its Rust
    backend directly, as the library would call it (no padding, no truncation, special tokens
    split or not as the tokenizer says): the library's Python around that call, a dict of
    lists built for every text, cost 4.5 of the 6 us a short text took of the calling thread
    (all-MiniLM's tokenizer, 2-core Xeon), held under the GIL that a worker's threads share."""
    backend = _rust_backend(type(tokenizer)) and tokenizer.backend_tokenizer
    if not backend:
        return tokenizer(texts, add_special_tokens=special)["input_ids"]
    if backend.truncation is not None:   # a tokenizer.json may set both (all-MiniLM-L6-v2: 128)
        backend.no_truncation()
    if backend.padding is not None:
        backend.no_padding()
    split = bool(getattr(tokenizer, "split_special_tokens", False))
    if backend.encode_special_tokens != split:
        backend.encode_special_tokens = split
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)   # (_fast: no character offsets)
    return [encoding.ids for encoding in encode(texts, add_special_tokens=special)]


@functools.cache
def _rust_backend(cls: type) -> bool:
    """Whether tokenizer class cls encodes a batch of texts exactly as transformers'
    PreTrainedTokenizerFast does: one of it whose calls no subclass changes, source/target
    modes included (a translation tokenizer's language tokens; transformers 4 gives every
    tokenizer an empty _switch_to_input_mode, 5 none)."""
    from transformers import PreTrainedTokenizerFast

    if not issubclass(cls, PreTrainedTokenizerFast):
        return False
    calls = ("__call__", "_call_one", "encode_plus", "batch_encode_plus", "_encode_plus", "_batch_encode_plus",
             "set_truncation_and_padding", "_switch_to_input_mode")
    return all(getattr(cls, name, None) is getattr(PreTrainedTokenizerFast, name, None) for name in calls)


def vocabulary_error(ids: Sequence[int], vocab_size: int) -> str | None:
    """Why a prompt's ids cannot run on a model of vocab_size tokens (an id the embedding
    table has no row for), or None. Checked per request, so a bad id fails its own request
    and never the engine step its neighbours share."""
    if ids and max(ids) >= vocab_size:
        return f"token id {max(ids)} is not in the model's vocabulary (ids 0 to {vocab_size - 1})"
    return None


def _rendered_together(tokenizer, indexes: list[int], conversations: list[list[dict]], effort: str | None,
                       ids: list) -> list[tuple[int, str] | None]:
    """Chats without tools, rendered in one call of the chat template (the library's batch:
    its per-call work is paid once, 30 -> 20 us a SmolLM2 chat); where that fails, one at a
    time, so that a bad message fails its own request only."""
    try:
        texts = tokenizer.apply_chat_template(conversations, tokenize=False, add_generation_prompt=True,
                                              **template_options(effort))
    except Exception:
        return [_rendered_or_error(tokenizer, i, c, None, effort, ids) for i, c in zip(indexes, conversations)]
    return list(zip(indexes, texts))


def _rendered_or_error(tokenizer, i: int, messages: list[dict], tools: list[dict] | None, effort: str | None,
                       ids: list) -> tuple[int, str] | None:
    """(i, the chat rendered alone), or None with the error that fails it in ids[i]."""
    try:
        return i, tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                                **template_options(effort))
    except Exception as e:   # a bad template or message fails its request only
        ids[i] = e
        return None


def _encoded_or_error(tokenizer, text: str, special: bool) -> list[int] | Exception:
    try:
        return tokenizer.encode(text, add_special_tokens=special)
    except Exception as e:
        return e


def _check_template_shows_tool_calls(tokenizer, messages: list[dict]) -> None:
    """Raise when a message has tool calls that the chat template never reads: that turn
    would reach the model empty, its calls silently gone (SmolLM2's template is such a one)."""
    if not any("tool_calls" in m for m in messages):
        return
    template = getattr(tokenizer, "chat_template", None) or ""
    if not any("tool_calls" in source for source in (template.values() if isinstance(template, dict) else [template])):
        raise ValueError("this model's chat template does not show an assistant's tool_calls (the turn would "
                         "reach the model without them): use a model whose template renders tool calls, or "
                         "write the call into that message's content")
