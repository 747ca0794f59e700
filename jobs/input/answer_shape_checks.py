"""The fields of a request that shape its answer: structured outputs, forced tool calls, logprobs.

Each check adds the user's message to `problems` for what is wrong (the line's error) and
returns the normalised setting for RequestSpec. Structured-output specs are checked by
pipeline.structured_output, once per distinct spec.
"""
from __future__ import annotations

import re

from jobs.input.field_checks import CHAT_ENDPOINT, Bad, int_in, check, describe
from pipeline.sampling_params import MAX_TOP_LOGPROBS
from pipeline.structured_output import KINDS as STRUCTURED_KINDS
from pipeline.structured_output import check as check_structured

RESPONSE_FORMATS = ("text", "json_object", "json_schema")
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def structured_output(req: dict, problems: list[str], labels: dict | None = None) -> dict | None:
    """The grammar the answer must follow (pipeline.structured_output's spec), from OpenAI's
    response_format or vLLM's structured_outputs; None for free text. An invalid schema,
    regex or grammar is a problem of the line (checked once per distinct spec), named as
    `labels` name the field (a responses body's text.format)."""
    given = [k for k in ("response_format", "structured_outputs") if req.get(k) is not None]
    if len(given) > 1:
        problems.append("give response_format or structured_outputs, not both")
        return None
    if not given:
        return None
    name = given[0]
    spec = check(_response_format if name == "response_format" else _structured_outputs, name, req[name], None,
                 problems)
    if spec is not None and (problem := check_structured(spec)) is not None:
        problems.append(f"{(labels or {}).get(name, name)}: {problem}")
        return None
    return spec


def _response_format(name, v, _):
    if not isinstance(v, dict) or v.get("type") not in RESPONSE_FORMATS:
        raise Bad(f"{name} must be an object with type {', '.join(map(repr, RESPONSE_FORMATS))}, got {describe(v)}")
    extra = sorted(v.keys() - {"type", "json_schema"})
    if extra:
        raise Bad(f"{name} has unsupported field {extra[0]!r}")
    if v["type"] == "text":
        return None
    if v["type"] == "json_object":
        return {"json_object": True}
    js = v.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
        raise Bad(f"{name}.json_schema must be an object with a schema object (and name, strict), "
                  f"got {describe(js)}")
    extra = sorted(js.keys() - {"name", "schema", "strict", "description"})
    if extra:
        raise Bad(f"{name}.json_schema has unsupported field {extra[0]!r}")
    return {"json": js["schema"]}


def _structured_outputs(name, v, _):
    if not isinstance(v, dict) or len(v) != 1 or next(iter(v)) not in STRUCTURED_KINDS:
        raise Bad(f"{name} must be an object with exactly one of {', '.join(STRUCTURED_KINDS)}, got {describe(v)}")
    return dict(v)


CHAT_FORCED_CALL = '{"type": "function", "function": {"name": ...}}'   # a forced tool_choice, as chat writes it


def forced_tool(req: dict, problems: list[str], forced_call: str = CHAT_FORCED_CALL,
                ) -> tuple[list[dict] | None, str | None, dict | None]:
    """A chat request's tools: (tools for the chat template, the function the answer must
    call, its structured-output spec over that function's parameters), or Nones.

    A call is forced by tool_choice naming a function, or "required" with one tool; the
    answer is then a JSON object valid under the function's parameters (its arguments).
    tool_choice "none" drops the tools. "auto" (the default with tools) and "required" with
    several tools would need the model's own tool-call syntax parsed: refused, for now.
    forced_call: how the line's API writes a forced tool_choice, for the errors' hints."""
    tools, choice = req.get("tools"), req.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            problems.append("tool_choice needs tools")
        return None, None, None
    tools = check(_tools, "tools", tools, None, problems)
    if tools is None or choice == "none":
        return None, None, None
    names = [tool["function"]["name"] for tool in tools]
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or name not in names:
            given = repr(name) if isinstance(name, str) else describe(choice)
            problems.append(f"tool_choice must name one of the tools ({', '.join(names)}) as {forced_call}, "
                            f"got {given}")
            return None, None, None
    elif choice == "required" and len(tools) == 1:
        name = names[0]
    else:
        why = (f"tool_choice \"required\" with {len(tools)} tools" if choice == "required" else
               f"tool_choice {describe(choice) if choice is not None else 'auto (the default with tools)'}")
        problems.append(f"{why} is not supported: the model's own tool-call format is not parsed; force one "
                        f'function with tool_choice {forced_call}, or "required" with a single tool')
        return None, None, None
    parameters = next(t["function"] for t in tools if t["function"]["name"] == name).get(
        "parameters", {"type": "object", "properties": {}})
    spec = {"json": parameters}
    if (problem := check_structured(spec)) is not None:
        problems.append(f"tools: the parameters of {name!r}: {problem}")
        return None, None, None
    return tools, name, spec


def _tools(name, v, _):
    if not isinstance(v, list) or not 1 <= len(v) <= 128:
        raise Bad(f"{name} must be a list of 1 to 128 function tools, got {describe(v)}")
    seen = set()
    for i, tool in enumerate(v):
        where = f"{name}[{i}]"
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict):
            raise Bad(f'{where} must be {{"type": "function", "function": {{"name", "parameters"}}}}, got {describe(tool)}')
        fname = function.get("name")
        if not isinstance(fname, str) or not FUNCTION_NAME.fullmatch(fname):
            raise Bad(f"{where}.function.name must be 1 to 64 letters, digits, _ or -, got {describe(fname)}")
        if fname in seen:
            raise Bad(f"{where}: a second tool named {fname!r}")
        seen.add(fname)
        if not isinstance(function.get("parameters", {}), dict):
            raise Bad(f"{where}.function.parameters must be a JSON schema object")
    return v


def echo_setting(req: dict, endpoint: str | None, problems: list[str]) -> bool:
    """OpenAI completions' echo: the answer's text starts with the prompt, and with logprobs
    its logprobs start with the prompt tokens' (the first one's null)."""
    value = req.get("echo")
    if value is None or endpoint is None:
        return False
    if not isinstance(value, bool):
        problems.append(f"echo must be true or false, got {describe(value)}")
        return False
    return value


def logprobs_setting(req: dict, endpoint: str | None, problems: list[str]) -> int | None:
    """How many top alternatives to return with each token's logprob (0: the token's only),
    or None for no logprobs. OpenAI's chat: logprobs true with top_logprobs 0..20; its
    completions: logprobs 0..5; ours: logprobs 0..20."""
    value = req.get("logprobs")
    if endpoint == CHAT_ENDPOINT:
        top = req.get("top_logprobs")
        if value is not None and not isinstance(value, bool):
            problems.append(f"logprobs must be true or false, got {describe(value)}")
            return None
        if top is not None and value is not True:
            problems.append("top_logprobs needs logprobs: true")
            return None
        if not value:
            return None
        return 0 if top is None else check(int_in(0, MAX_TOP_LOGPROBS), "top_logprobs", top, None, problems)
    if value is None:
        return None
    return check(int_in(0, 5 if endpoint is not None else MAX_TOP_LOGPROBS), "logprobs", value, None, problems)
