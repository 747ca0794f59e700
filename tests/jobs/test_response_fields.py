"""/v1/responses lines (jobs.input.responses_body): each is the request its chat completions
equivalent is, field for field, and what a batch cannot do is a bad line named in the
Responses API's own words."""
from __future__ import annotations

import json

import pytest
from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText

from jobs.input.line_checks import Limits, iter_lines, validate

CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def write(tmp_path, lines, name) -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def line(custom_id, body, url) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "m", **body}}


def specs(tmp_path, bodies, url) -> list[dict]:
    """The request each body becomes (its spec's fields but the line number), none refused."""
    items = [item for _, item in iter_lines(write(tmp_path, [line(f"r{i}", b, url) for i, b in enumerate(bodies)],
                                                  url.rsplit("/", 1)[1] + ".jsonl"), Limits())]
    assert all(hasattr(item, "messages") for item in items), items
    return [{k: v for k, v in item.to_dict().items() if k != "line"} for item in items]


def errors_by_line(tmp_path, bodies) -> dict[int, str]:
    v = validate(write(tmp_path, [line(f"r{i}", b, RESPONSES) for i, b in enumerate(bodies)], "bad.jsonl"), Limits())
    return {e.line: e.message for e in v.errors}


def test_each_responses_body_is_the_request_its_chat_body_is(tmp_path):
    # An earlier response's output items given back as input, as an SDK user appends them.
    answer = ResponseOutputMessage(id="msg_1", type="message", role="assistant", status="completed", content=[
        ResponseOutputText(type="output_text", text="Paris.", annotations=[], logprobs=[])]).model_dump()
    calls = [ResponseFunctionToolCall(type="function_call", call_id=f"call_{i}", name="get_weather",
                                      arguments=json.dumps({"city": city}), id=f"fc_{i}", status="completed"
                                      ).model_dump() for i, city in enumerate(["Paris", "Rome"])]
    tool = {"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER,
            "strict": True}
    pairs = [
        ({"input": "What is the capital of France?", "instructions": "Answer in one word.",
          "max_output_tokens": 8, "temperature": 0, "top_p": 0.5},
         {"messages": [{"role": "system", "content": "Answer in one word."},
                       {"role": "user", "content": "What is the capital of France?"}],
          "max_tokens": 8, "temperature": 0, "top_p": 0.5}),
        ({"input": [{"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
                    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                                    {"type": "input_text", "text": "b"}]},
                    answer, {"role": "user", "content": "And Italy?"}]},
         {"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "a\nb"},
                       {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Italy?"}]}),
        ({"input": [{"role": "user", "content": "Weather in Paris and Rome?"}, *calls,
                    {"type": "function_call_output", "call_id": "call_0", "output": "sunny"},
                    {"type": "function_call_output", "call_id": "call_1",
                     "output": [{"type": "input_text", "text": "rain"}]}],
          "tools": [tool], "tool_choice": {"type": "function", "name": "get_weather"}},
         {"messages": [{"role": "user", "content": "Weather in Paris and Rome?"},
                       {"role": "assistant", "content": None, "tool_calls": [
                           {"id": f"call_{i}", "type": "function",
                            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
                           for i, city in enumerate(["Paris", "Rome"])]},
                       {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
                       {"role": "tool", "tool_call_id": "call_1", "content": "rain"}],
          "tools": [{"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}],
          "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
        ({"input": "Extract: Alice is 30.", "text": {"format": {"type": "json_schema", "name": "person",
                                                                "schema": SCHEMA, "strict": True}}},
         {"messages": [{"role": "user", "content": "Extract: Alice is 30."}],
          "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA,
                                                                     "strict": True}}}),
        ({"input": "hi", "text": {"format": {"type": "json_object"}}},
         {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}}),
        ({"input": "hi", "top_logprobs": 3, "include": ["message.output_text.logprobs"]},
         {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 3}),
        ({"input": "hi", "include": ["message.output_text.logprobs"]},
         {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}),
        ({"input": "hi", "reasoning": {"effort": "none", "summary": "auto"}},
         {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "none"}),
        # Taken and ignored: what changes nothing about the answer in a batch, and any null.
        ({"input": "hi", "store": False, "metadata": {"team": "a"}, "user": "u", "service_tier": "auto",
          "truncation": "auto", "max_tool_calls": 2, "background": False, "stream": False,
          "prompt_cache_key": "nightly", "safety_identifier": "s", "include": [], "reasoning": None,
          "previous_response_id": None, "text": {"format": {"type": "text"}}, "instructions": ""},
         {"messages": [{"role": "user", "content": "hi"}]}),
    ]
    ours = specs(tmp_path, [responses for responses, _ in pairs], RESPONSES)
    theirs = specs(tmp_path, [chat for _, chat in pairs], CHAT)
    assert ours == theirs
    assert ours[2]["tool_call"] == "get_weather" and ours[3]["structured_output"] == {"json": SCHEMA}
    assert (ours[5]["logprobs"], ours[6]["logprobs"]) == (3, 0)


def test_what_a_batch_cannot_do_is_a_bad_line_in_the_responses_words(tmp_path):
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    bad = errors_by_line(tmp_path, [
        {"input": "hi", "previous_response_id": "resp_1"},
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
        {"input": "hi", "tools": [{"type": "web_search"}]},
        {"input": "hi", "tools": [tool]},
        {"input": "hi", "tools": [tool], "tool_choice": {"type": "function", "name": "g"}},
        {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objekt"}}}},
        {"input": "hi", "max_output_tokens": 0},
        {"input": "hi", "reasoning": {"effort": "extreme"}, "text": {"verbosity": "low"}},
        {"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{bad"}]},
        {"instructions": "Be brief."},
        {"input": "hi", "stream": True, "truncation": "middle"},
        {"input": [{"type": "item_reference", "id": "msg_1"}]},
        {"input": "hi", "top_logprobs": 30},
        {"input": [{"role": "tool", "content": "x"}]},
        {"input": "hi", "conversation": "conv_1", "prompt": {"id": "pmpt_1"}, "modalities": ["text"]},
        {"input": "hi", "tools": [{**tool, "name": "bad name"}], "tool_choice": "required"},
        {"input": "hi", "tools": [{**tool, "parameters": "city"}], "tool_choice": "required", "instructions": 5},
        {"input": "hi", "tools": [tool, {**tool, "name": "g"}], "tool_choice": "required"},
    ])
    assert bad == {
        1: "unsupported field 'previous_response_id' (a batch keeps no responses: give the whole conversation "
           "in input)",
        2: "input[0].content[0] has type 'input_image'; only text parts (input_text, output_text) are supported "
           "(the models served read text only)",
        3: "tools[0] has type 'web_search'; only function tools are supported (a batch runs no hosted tools)",
        4: "tool_choice auto (the default with tools) is not supported: the model's own tool-call format is not "
           'parsed; force one function with tool_choice {"type": "function", "name": ...}, or "required" with a '
           "single tool",
        5: 'tool_choice must name one of the tools (f) as {"type": "function", "name": ...}, got \'g\'',
        6: "text.format: Invalid type: objekt",
        7: "max_output_tokens must be between 1 and 1000000, got 0",
        8: "text has unsupported field 'verbosity' (the model's own length is not steered); reasoning.effort must "
           "be one of 'none', 'minimal', 'low', 'medium', 'high', 'xhigh', 'max', got 'extreme'",
        9: "input[0].arguments is not valid JSON (Expecting property name enclosed in double quotes: line 1 "
           "column 2 (char 1))",
        10: "missing body.input",
        11: "unsupported field 'stream' = true: a batch writes its answers to the results (leave stream out, or "
            "false); truncation must be one of 'auto', 'disabled', got 'middle'",
        12: "input[0] is an item_reference: a batch keeps no stored items; give the item itself",
        13: "top_logprobs must be between 0 and 20, got 30",
        14: "input[0].role must be one of user, system, developer, assistant, got 'tool'",
        15: "unsupported field 'conversation' (a batch keeps no conversations: give the whole conversation in "
            "input); unsupported field 'modalities'; unsupported field 'prompt' (stored prompt templates are not "
            "available: give the text in instructions and input)",
        16: "tools[0].name must be 1 to 64 letters, digits, _ or -, got 'bad name'",
        17: "instructions must be a non-empty string, got 5; tools[0].parameters must be a JSON schema object, "
            "got 'city'",
        18: 'tool_choice "required" with 2 tools is not supported: the model\'s own tool-call format is not parsed; '
            'force one function with tool_choice {"type": "function", "name": ...}, or "required" with a single tool',
    }
    # A chat line's hints show chat's form of the same choice.
    chat_tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    chat = {"messages": [{"role": "user", "content": "hi"}], "tools": [chat_tool]}
    v = validate(write(tmp_path, [line("a", chat, CHAT), line("b", {**chat, "tool_choice": {
        "type": "function", "function": {"name": "g"}}}, CHAT)], "chat.jsonl"), Limits())
    assert [e.message for e in v.errors] == [
        "tool_choice auto (the default with tools) is not supported: the model's own tool-call format is not parsed; "
        'force one function with tool_choice {"type": "function", "function": {"name": ...}}, or "required" with a '
        "single tool",
        'tool_choice must name one of the tools (f) as {"type": "function", "function": {"name": ...}}, got \'g\'']


@pytest.mark.parametrize("url", [CHAT, RESPONSES])
def test_a_file_is_one_endpoint(tmp_path, url):
    other = RESPONSES if url == CHAT else CHAT
    body = {"input": "hi"} if url == RESPONSES else {"messages": [{"role": "user", "content": "hi"}]}
    v = validate(write(tmp_path, [line("a", body, url), line("b", body, other)], "mixed.jsonl"), Limits())
    assert [(e.line, e.message) for e in v.errors] == [
        (2, f"url {other!r} differs from {url!r} of line 1; every line of a batch must use the same url")]


def test_instructions_input_and_call_arguments_count_toward_the_character_limit(tmp_path):
    call = {"type": "function_call", "call_id": "c", "name": "f", "arguments": json.dumps({"a": "y" * 20})}
    bodies = [{"instructions": "x" * 10, "input": "x" * 10}, {"input": [{"role": "user", "content": "x" * 10}, call]}]
    v = validate(write(tmp_path, [line(f"r{i}", b, RESPONSES) for i, b in enumerate(bodies)], "long.jsonl"),
                 Limits(max_prompt_chars=25))
    assert [(e.line, e.message) for e in v.errors] == [
        (2, "instructions and input have 40 characters of content in all; the limit is 25")]
