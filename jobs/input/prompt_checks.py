"""Checking a request's input: a raw prompt (or several, or token ids, as OpenAI's completions
take them), or chat messages put in the form chat templates take (transformers'
`apply_chat_template`, as vLLM gives them).

A message is what OpenAI's chat format allows of text:
* `content` a string, or a list of text parts (`{"type": "text", "text": ...}`), joined with
  a newline as vLLM joins them; an image, audio or file part is a bad line naming it, since
  the models we serve read text only;
* `name` (the participant's), kept for templates that show it;
* an assistant's `tool_calls` (its content may then be null: it becomes ""), each call's
  `arguments` JSON string parsed into the object templates expect (vLLM does the same);
* a tool result's `tool_call_id`;
* any other field only as null (an SDK's message object dumped whole: `refusal`, `audio`).
A model whose chat template cannot show tool calls fails such a request alone, saying so
(pipeline.prompts): its turn would otherwise reach the model empty. `reasoning_effort` goes
to the chat template with the messages (pipeline.reasoning.template_options).
"""
from __future__ import annotations

import json

from jobs.input.field_checks import CHAT_ROLES, Bad, check, describe, encodable, string
from jobs.input.strict_json import DECODER, too_deep
from jobs.input.validation import Limits
from pipeline.reasoning import EFFORTS

MAX_ITEMS = 2048             # prompts or embedding inputs in one request (OpenAI's limit of inputs)
MAX_TOKEN_ID = 2**31 - 1
CONTENT_PARTS_JOINER = "\n"
MAX_TOOL_CALLS = 128
MAX_ARGUMENTS_DEPTH = Limits().max_depth   # a call's arguments may nest as deep as a whole line
_KEYS = {"role", "content", "name"}
_ROLE_KEYS = {"assistant": _KEYS | {"tool_calls"}, "tool": _KEYS | {"tool_call_id"}}


def request_inputs(req: dict, max_chars: int, problems: list[str]) -> dict:
    """The prompt, prompts or messages of a request (presence is checked by the format-specific
    code). A list `prompt` (OpenAI completions': several texts, or token ids) becomes `prompts`,
    unless it is one text."""
    out = {"prompt": None, "messages": None, "prompts": None}
    prompt, messages = req.get("prompt"), req.get("messages")
    if isinstance(prompt, list):
        prompts = check(texts_or_token_ids, "prompt", prompt, max_chars, problems)
        if prompts is not None and len(prompts) == 1 and isinstance(prompts[0], str):
            out["prompt"] = prompts[0]   # the same request as that text alone (its key too)
        else:
            out["prompts"] = prompts
    elif prompt is not None:
        out["prompt"] = check(_prompt, "prompt", prompt, max_chars, problems)
    if messages is not None:
        out["messages"] = check(_messages, "messages", messages, max_chars, problems)
    return out


def reasoning_effort(req: dict, problems: list[str]) -> str | None:
    """A chat request's reasoning_effort (OpenAI's values), or None: the template's default."""
    value = req.get("reasoning_effort")
    if value is None:
        return None
    if value not in EFFORTS or not isinstance(value, str):
        problems.append(f"reasoning_effort must be one of {', '.join(map(repr, EFFORTS))}, got {describe(value)}")
        return None
    if req.get("messages") is None:
        problems.append("reasoning_effort needs messages (a chat request): it is given to the chat template")
    return value


def _prompt(name, v, max_chars):
    if isinstance(v, str) and not v:
        raise Bad(f"{name} is empty")
    return string(name, v, max_chars)


def texts_or_token_ids(name, v, max_chars) -> list:
    """One text, a list of texts, one list of token ids, or a list of such lists (OpenAI's
    forms of completions' `prompt` and embeddings' `input`), as a list of texts or of
    token-id lists."""
    if isinstance(v, str):
        return [string(name, v, max_chars)]
    if not isinstance(v, list) or not v:
        raise Bad(f"{name} must be a string, a list of strings or token ids, got {describe(v)}")
    if len(v) > MAX_ITEMS:
        raise Bad(f"{name} has {len(v)} items; at most {MAX_ITEMS} are allowed (split it over several lines)")
    if all(type(x) is int for x in v):   # one item given as token ids
        return [_token_ids(name, v)]
    if all(isinstance(x, str) for x in v):
        items = [string(f"{name}[{i}]", x, max_chars) for i, x in enumerate(v)]
        total = sum(map(len, items))
        if total > max_chars:
            raise Bad(f"{name} has {total} characters in all; the limit is {max_chars}")
        return items
    if all(isinstance(x, list) for x in v):
        return [_token_ids(f"{name}[{i}]", x) for i, x in enumerate(v)]
    raise Bad(f"{name} must be all strings, all token ids or all lists of token ids, not a mix")


def _token_ids(name, v):
    if not v:
        raise Bad(f"{name} is an empty list of token ids")
    for i, t in enumerate(v):
        if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID:
            raise Bad(f"{name}[{i}] must be a token id (an integer >= 0), got {describe(t)}")
    return list(v)


def _messages(name, v, max_chars):
    if not isinstance(v, list) or not v:
        raise Bad(f"{name} must be a non-empty list of {{\"role\", \"content\"}} objects, got {describe(v)}")
    out, total = [], 0
    for i, m in enumerate(v):
        # The usual message (role and a string content) passes these tests at once.
        if type(m) is dict and len(m) == 2 and m.get("role") in CHAT_ROLES and type(m.get("content")) is str:
            content = m["content"]
            if not content.isascii():   # only non-ASCII text can hold a lone surrogate
                encodable(f"{name}[{i}].content", content)
            message, size = {"role": m["role"], "content": content}, len(content)
        else:
            message, size = _message(f"{name}[{i}]", m, max_chars)
        total += size
        out.append(message)
    if total > max_chars:
        raise Bad(f"{name} have {total} characters of content in all; the limit is {max_chars}")
    return out


def _message(where: str, m, max_chars: int) -> tuple[dict, int]:
    """Any other message, checked field by field: (its template form, its characters)."""
    if not isinstance(m, dict):
        raise Bad(f"{where} must be an object with role and content, got {describe(m)}")
    role = m.get("role")
    if not isinstance(role, str) or not role:
        raise Bad(f"{where}.role must be a non-empty string, got {describe(role)}")
    if role not in CHAT_ROLES:
        raise Bad(f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {describe(role)}")
    allowed = _ROLE_KEYS.get(role, _KEYS)
    extra = sorted(k for k in m.keys() - allowed if m[k] is not None)   # a null: as if left out
    if extra:
        raise Bad(f"{where} has unsupported field {extra[0]!r} (a {role} message takes "
                  f"{', '.join(sorted(allowed))})")
    message, size = {"role": role}, 0
    tool_calls = m.get("tool_calls")
    if tool_calls is not None:
        message["tool_calls"], size = _tool_calls(f"{where}.tool_calls", tool_calls, max_chars)
    content = m.get("content")
    if content is None and tool_calls is not None:
        content = ""   # a turn of tool calls only; templates concatenate content, so never None
    message["content"] = content_text(f"{where}.content", content)
    size += len(message["content"])
    if m.get("name") is not None:
        message["name"] = string(f"{where}.name", m["name"], max_chars)
        size += len(message["name"])
    if m.get("tool_call_id") is not None:   # OpenAI's require it; a template may not read it
        message["tool_call_id"] = string(f"{where}.tool_call_id", m["tool_call_id"], max_chars)
    return message, size


def content_text(where: str, content, part_types: tuple[str, ...] = ("text",),
                 ignored_keys: frozenset[str] = frozenset()) -> str:
    """A message's text: a string, or its text parts joined (`part_types`: what the API calls a
    text part, chat's "text" or the Responses API's "input_text"/"output_text"; `ignored_keys`:
    the other fields such a part may carry)."""
    if isinstance(content, str):
        encodable(where, content)
        return content
    if not isinstance(content, list) or not content:
        raise Bad(f"{where} must be a string or a non-empty list of text parts, got {describe(content)}")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in part_types:
            if isinstance(kind, str) and kind:
                named = "" if part_types == ("text",) else f" ({', '.join(part_types)})"
                raise Bad(f"{where}[{j}] has type {kind!r}; only text parts{named} are supported (the models "
                          "served read text only)")
            raise Bad(f"{where}[{j}] must be a text part {{\"type\": \"{part_types[0]}\", \"text\": ...}}, "
                      f"got {describe(part)}")
        extra = sorted(part.keys() - {"type", "text"} - ignored_keys)
        if extra:
            raise Bad(f"{where}[{j}] has unsupported field {extra[0]!r}")
        text = part.get("text")
        if not isinstance(text, str):
            raise Bad(f"{where}[{j}].text must be a string, got {describe(text)}")
        encodable(f"{where}[{j}].text", text)
        texts.append(text)
    return CONTENT_PARTS_JOINER.join(texts)


def _tool_calls(where: str, calls, max_chars: int) -> tuple[list[dict], int]:
    """An assistant's tool calls, their arguments as objects: (calls, characters)."""
    if not isinstance(calls, list) or not 1 <= len(calls) <= MAX_TOOL_CALLS:
        raise Bad(f"{where} must be a list of 1 to {MAX_TOOL_CALLS} tool calls, got {describe(calls)}")
    out, size = [], 0
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, dict) or call.get("type", "function") != "function" \
                or not isinstance(call.get("function"), dict):
            raise Bad(f"{at} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}, "
                      f"got {describe(call)}")
        function = call["function"]
        extra = sorted(call.keys() - {"id", "type", "function"}) or sorted(function.keys() - {"name", "arguments"})
        if extra:
            raise Bad(f"{at} has unsupported field {extra[0]!r}")
        name = string(f"{at}.function.name", function.get("name"), max_chars)
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            raise Bad(f"{at}.function.arguments must be a string of JSON, got {describe(arguments)}")
        arguments_object = tool_call_arguments(f"{at}.function.arguments", arguments)
        out.append({"id": string(f"{at}.id", call.get("id"), max_chars), "type": "function",
                    "function": {"name": name, "arguments": arguments_object}})
        size += len(name) + len(arguments)
    return out, size


def tool_call_arguments(where: str, text: str) -> dict:
    """A call's arguments as the object chat templates show (an empty string: no arguments)."""
    if not text.strip():
        return {}
    try:
        value = DECODER.decode(text)
    except RecursionError:   # the C scanner's own limit, far past ours
        value = None
    except ValueError as e:
        raise Bad(f"{where} is not valid JSON ({e})") from None
    if value is None or too_deep(value, MAX_ARGUMENTS_DEPTH):
        raise Bad(f"{where} is nested too deeply (the limit is {MAX_ARGUMENTS_DEPTH} levels)")
    if not isinstance(value, dict):
        raise Bad(f"{where} must be a JSON object, got {describe(value)}")
    encodable(where, json.dumps(value, ensure_ascii=False))   # a \ud800 escape decodes to a lone surrogate
    return value
