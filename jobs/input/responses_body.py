"""OpenAI's /v1/responses body, read as the /v1/chat/completions body it amounts to.

A Responses request is a chat request in other words: `instructions` is a system message
before the rest, `input` a string (one user message) or a list of items (messages with
`input_text`/`output_text` parts, and the `function_call` / `function_call_output` items of a
tool conversation), `max_output_tokens` is max_tokens, `text.format` is response_format
(flattened: `{"type": "json_schema", "name", "schema", "strict"}`), `tools` are flattened
function tools and `tool_choice: {"type": "function", "name"}` forces one, `top_logprobs`
and `include: ["message.output_text.logprobs"]` ask for logprobs, `reasoning.effort` is
reasoning_effort. So it is checked here in
its own words (errors name `input[2].content[0]`, `text.format`, `max_output_tokens`) and
then passes the chat checks like any chat line: the same request spec, the same answer.

A batch keeps no responses, so what refers to a stored one (`previous_response_id`,
`conversation`, `item_reference` items, stored `prompt`s) is a bad line, as are hosted
tools and non-text input. The answer's shape: jobs.results.openai_output.
"""
from __future__ import annotations

from jobs.input.answer_shape_checks import FUNCTION_NAME
from jobs.input.prompt_checks import content_text, tool_call_arguments
from jobs.input.field_checks import IGNORED_BODY_KEYS, Bad, check, describe, string
from pipeline.reasoning import EFFORTS

LOGPROBS_INCLUDE = "message.output_text.logprobs"
FORCED_CALL = '{"type": "function", "name": ...}'   # a forced tool_choice, as this API writes it
# Body fields a batch takes and ignores, beyond chat's (jobs.input.field_checks.IGNORED_BODY_KEYS):
# tools are never run here, so a cap on their calls changes nothing; input that fits is not
# truncated either way (input that does not is a bad line, as in chat); background and
# stream only when false. (modalities is chat's: this API has none.)
_IGNORED = (IGNORED_BODY_KEYS - {"modalities"}) | {"max_tool_calls", "truncation", "background", "include"}
_TRUNCATION = ("auto", "disabled")
# Fields that need something a batch does not keep or do: a bad line saying why.
_REFUSED = {
    "previous_response_id": "a batch keeps no responses: give the whole conversation in input",
    "conversation": "a batch keeps no conversations: give the whole conversation in input",
    "prompt": "stored prompt templates are not available: give the text in instructions and input",
    "context_management": "a batch request is answered in one turn",
}
_CHAT_KEYS = ("temperature", "top_p", "parallel_tool_calls")   # the same name and meaning
_MESSAGE_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text")
_GIVEN_BACK = frozenset({"annotations", "logprobs"})   # an earlier response's output_text part carries them
_FORMAT_KEYS = {"type", "name", "schema", "strict", "description"}


def responses_body(body: dict, max_model_chars: int, max_chars: int, problems: list[str]):
    """As jobs.input.field_checks.openai_body for a chat body: (model, the request fields of the
    chat body `body` amounts to, labels naming its renamed fields in the chat checks' errors)."""
    given = {k: v for k, v in body.items() if v is not None}   # a null: as if left out
    model = check(string, "model", given["model"], max_model_chars, problems) if "model" in given else None
    for k in sorted(given.keys() - _KNOWN):
        why = _REFUSED.get(k)
        problems.append(f"unsupported field {k!r}" + (f" ({why})" if why else ""))
    for flag in ("stream", "background"):
        if given.get(flag, False) is not False:
            problems.append(f"unsupported field {flag!r} = {describe(given[flag])}: a batch writes its answers "
                            f"to the results (leave {flag} out, or false)")
    if given.get("truncation", "disabled") not in _TRUNCATION:
        problems.append(f"truncation must be one of {', '.join(map(repr, _TRUNCATION))}, "
                        f"got {describe(given['truncation'])}")
    chat = {k: given[k] for k in _CHAT_KEYS if k in given}
    labels = {"response_format": "text.format"}
    if "max_output_tokens" in given:
        chat["max_tokens"], labels["max_tokens"] = given["max_output_tokens"], "max_output_tokens"
    messages = _run(_messages, given, max_chars, problems)
    if messages is not None:
        chat["messages"] = messages
    elif "input" not in given:
        problems.append("missing body.input")
    for key, read in (("text", _text), ("tools", _tools), ("tool_choice", _tool_choice),
                      ("reasoning", _reasoning)):
        if key in given:
            value = _run(read, given, max_chars, problems)
            if value is not None:
                chat.update(value)
    if "tools" in given and "tools" not in chat:
        chat.pop("tool_choice", None)   # the tools' own problem is the line's; the choice has nothing to name
    _logprobs(given, chat, problems)
    return model, chat, labels


_KNOWN = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "text", "tools",
          "tool_choice", "parallel_tool_calls", "top_logprobs", "reasoning", *_IGNORED}


def _run(read, given: dict, max_chars: int, problems: list[str]):
    try:
        return read(given, max_chars)
    except Bad as e:
        problems.append(str(e))


def _messages(given: dict, max_chars: int) -> list[dict] | None:
    """instructions and input as chat messages (their content strings, a call's arguments still
    its JSON text, as a chat line gives them); None when input is missing."""
    items = given.get("input")
    if items is None:
        return None
    messages = []
    if given.get("instructions", "") != "":   # an empty one is none
        messages.append({"role": "system", "content": string("instructions", given["instructions"], max_chars)})
    if isinstance(items, str):
        items = [{"role": "user", "content": string("input", items, max_chars)}]
    elif not isinstance(items, list) or not items:
        raise Bad(f"input must be a string or a non-empty list of items, got {describe(items)}")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise Bad(f"{where} must be an object (a message or a function call item), got {describe(item)}")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(where, item))
        elif kind == "function_call":
            call = _function_call(where, item, max_chars)
            previous = messages[-1] if messages else None
            if previous is not None and previous.get("tool_calls") and not previous["content"]:
                previous["tool_calls"].append(call)   # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(_function_call_output(where, item, max_chars))
        elif kind == "item_reference":
            raise Bad(f"{where} is an item_reference: a batch keeps no stored items; give the item itself")
        else:
            raise Bad(f"{where} has type {describe(kind)}; an input item is a message, a function_call or a "
                      "function_call_output")
    total = sum(len(m["content"]) + sum(len(c["function"]["name"]) + len(c["function"]["arguments"])
                                        for c in m.get("tool_calls", ())) for m in messages)   # as chat counts
    if total > max_chars:
        raise Bad(f"instructions and input have {total} characters of content in all; the limit is {max_chars}")
    return messages


def _message(where: str, item: dict) -> dict:
    role = item.get("role")
    if role not in _MESSAGE_ROLES:
        raise Bad(f"{where}.role must be one of {', '.join(_MESSAGE_ROLES)}, got {describe(role)}")
    _no_other_fields(where, item, {"role", "content"})
    return {"role": role, "content": _content(f"{where}.content", item.get("content"))}


def _content(where: str, content) -> str:
    """A string, or text parts joined as chat's are (jobs.input.prompt_checks)."""
    return content_text(where, content, _TEXT_PARTS, _GIVEN_BACK)


def _function_call(where: str, item: dict, max_chars: int) -> dict:
    _no_other_fields(where, item, {"call_id", "name", "arguments"})
    call_id = string(f"{where}.call_id", item.get("call_id"), max_chars)
    name = string(f"{where}.name", item.get("name"), max_chars)
    arguments = item.get("arguments")
    if not isinstance(arguments, str):
        raise Bad(f"{where}.arguments must be a string of JSON, got {describe(arguments)}")
    tool_call_arguments(f"{where}.arguments", arguments)   # a bad line here, named as the input names it
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _function_call_output(where: str, item: dict, max_chars: int) -> dict:
    _no_other_fields(where, item, {"call_id", "output"})
    return {"role": "tool", "tool_call_id": string(f"{where}.call_id", item.get("call_id"), max_chars),
            "content": _content(f"{where}.output", item.get("output"))}


def _text(given: dict, _) -> dict | None:
    """text.format as chat's response_format."""
    text = given["text"]
    if not isinstance(text, dict):
        raise Bad(f"text must be an object with format, got {describe(text)}")
    extra = sorted(k for k in text.keys() - {"format"} if text[k] is not None)
    if extra:
        raise Bad(f"text has unsupported field {extra[0]!r}" + (
            " (the model's own length is not steered)" if extra[0] == "verbosity" else ""))
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise Bad("text.format must be an object with type 'text', 'json_object' or 'json_schema', "
                  f"got {describe(fmt)}")
    extra = sorted(fmt.keys() - _FORMAT_KEYS)
    if extra:
        raise Bad(f"text.format has unsupported field {extra[0]!r}")
    if fmt["type"] != "json_schema":
        return {"response_format": {"type": fmt["type"]}}
    if not isinstance(fmt.get("schema"), dict):
        raise Bad(f"text.format.schema must be a JSON schema object, got {describe(fmt.get('schema'))}")
    return {"response_format": {"type": "json_schema",
                                "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                if k in fmt}}}


def _reasoning(given: dict, _) -> dict:
    """reasoning.effort as chat's reasoning_effort. A summary cannot be asked for: the output's
    reasoning item carries the whole think block instead, so summary is taken and ignored."""
    reasoning = given["reasoning"]
    if not isinstance(reasoning, dict):
        raise Bad(f"reasoning must be an object with effort, got {describe(reasoning)}")
    extra = sorted(k for k in reasoning.keys() - {"effort", "summary", "generate_summary"} if reasoning[k] is not None)
    if extra:
        raise Bad(f"reasoning has unsupported field {extra[0]!r}")
    effort = reasoning.get("effort")
    if effort is not None and (not isinstance(effort, str) or effort not in EFFORTS):
        raise Bad(f"reasoning.effort must be one of {', '.join(map(repr, EFFORTS))}, got {describe(effort)}")
    return {} if effort is None else {"reasoning_effort": effort}


def _tools(given: dict, _) -> dict:
    """Flattened function tools as chat's."""
    tools = given["tools"]
    if not isinstance(tools, list) or not tools:
        raise Bad(f"tools must be a non-empty list of function tools, got {describe(tools)}")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise Bad(f"tools[{i}] has type {describe(kind)}; only function tools are supported (a batch runs no "
                      "hosted tools)")
        extra = sorted(tool.keys() - {"type", "name", "description", "parameters", "strict"})
        if extra:
            raise Bad(f"tools[{i}] has unsupported field {extra[0]!r}")
        if not isinstance(tool.get("name"), str) or not FUNCTION_NAME.fullmatch(tool["name"]):
            raise Bad(f"tools[{i}].name must be 1 to 64 letters, digits, _ or -, got {describe(tool.get('name'))}")
        if not isinstance(tool.get("parameters", {}), dict):
            raise Bad(f"tools[{i}].parameters must be a JSON schema object, got {describe(tool['parameters'])}")
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters",
                                                                          "strict") if tool.get(k) is not None}})
    return {"tools": out}


def _tool_choice(given: dict, _) -> dict:
    choice = given["tool_choice"]
    if choice in ("none", "required"):
        return {"tool_choice": choice}
    if isinstance(choice, dict) and choice.get("type") == "function" and choice.keys() == {"type", "name"}:
        return {"tool_choice": {"type": "function", "function": {"name": choice["name"]}}}
    if choice == "auto":
        return {}   # the default with tools (refused by the chat checks: jobs.input.answer_shape_checks.forced_tool)
    raise Bad('tool_choice must be "none", "required" or {"type": "function", "name": ...} (a batch runs no '
              f"hosted tools), got {describe(choice)}")


def _logprobs(given: dict, chat: dict, problems: list[str]) -> None:
    """top_logprobs, or the logprobs include, as chat's logprobs: true (with top_logprobs)."""
    include = given.get("include", [])
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        problems.append(f"include must be a list of strings, got {describe(include)}")
        return
    if LOGPROBS_INCLUDE in include or "top_logprobs" in given:
        chat["logprobs"] = True
        if "top_logprobs" in given:
            chat["top_logprobs"] = given["top_logprobs"]


def _no_other_fields(where: str, item: dict, fields: set[str]) -> None:
    """An input item holds its type and `fields`; an earlier response's output item, given back
    whole, also its id and status; any other field only as null."""
    extra = sorted(k for k in item.keys() - fields - {"type", "id", "status"} if item[k] is not None)
    if extra:
        raise Bad(f"{where} has unsupported field {extra[0]!r}")
