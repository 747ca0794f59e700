"""Chat messages as OpenAI's format writes them (jobs.input.prompt_checks): text parts, names, a
conversation's tool calls and results, an SDK's message dumped whole; completions' prompt as
a list of texts or token ids; and OpenAI body fields given as null. Each is taken in the form
chat templates (and the engine) read, or refused with its line."""
from __future__ import annotations

import json

from openai.types.chat import ChatCompletionMessage

from jobs.input.line_checks import Limits, iter_lines, validate

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}


def write(tmp_path, lines, name="input.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def batch_line(custom_id, body, url=CHAT) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "m", **body}}


def messages_of(tmp_path, lines) -> list[list[dict]]:
    items = [item for _, item in iter_lines(write(tmp_path, lines), Limits())]
    assert not [i for i in items if not hasattr(i, "messages")], items   # no line refused
    return [item.messages for item in items]


def errors_by_line(tmp_path, lines) -> dict[int, str]:
    v = validate(write(tmp_path, lines, "bad.jsonl"), Limits())
    return {e.line: e.message for e in v.errors}


def test_openai_message_shapes_are_taken_in_the_form_chat_templates_read(tmp_path):
    # What an SDK user appends after a tool-calling turn: the response's message, dumped whole.
    sdk_turn = ChatCompletionMessage(role="assistant", content=None, tool_calls=[CALL]).model_dump()
    assert sdk_turn["refusal"] is None and sdk_turn["audio"] is None   # nulls the check must take as absent
    got = messages_of(tmp_path, [
        batch_line("parts", {"messages": [
            {"role": "system", "content": [{"type": "text", "text": "Be terse."}]},
            {"role": "user", "name": "bob", "content": [{"type": "text", "text": "Say hi"},
                                                        {"type": "text", "text": "please"}]}]}),
        batch_line("tools", {"messages": [
            {"role": "user", "content": "Weather in Paris?"}, sdk_turn,
            {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "22C, sunny"}]},
            {"role": "assistant", "content": "It is sunny.", "tool_calls": [
                {**CALL, "id": "call_2", "function": {"name": "noop", "arguments": ""}}]}]}),
        {"custom_id": "plain", "method": "POST", "url": CHAT,
         "body": {"messages": [{"role": "user", "content": "hi"}]}},
    ])
    assert got[0] == [{"role": "system", "content": "Be terse."},
                      {"role": "user", "content": "Say hi\nplease", "name": "bob"}]   # parts joined as vLLM does
    arguments_as_object = {**CALL, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    assert got[1] == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [arguments_as_object], "content": ""},
        {"role": "tool", "content": "22C, sunny", "tool_call_id": "call_1"},
        {"role": "assistant", "tool_calls": [{**CALL, "id": "call_2", "function": {"name": "noop", "arguments": {}}}],
         "content": "It is sunny."}]
    assert got[2] == [{"role": "user", "content": "hi"}]


def test_messages_that_cannot_be_shown_as_text_are_refused_with_their_line(tmp_path):
    def chat(*messages):
        return {"messages": [{"role": "user", "content": "hi"}, *messages]}
    lines = [
        chat({"role": "user", "content": [{"type": "text", "text": "a"},
                                          {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}),  # 1
        chat({"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}),
        chat({"role": "user", "content": []}),                                                                # 3
        chat({"role": "user", "content": ["just a string"]}),                                                 # 4
        chat({"role": "user", "content": [{"type": "text"}]}),                                                # 5
        chat({"role": "user", "content": "a", "tool_calls": [CALL]}),                                         # 6
        chat({"role": "assistant", "content": None}),                                                         # 7
        chat({"role": "tool", "content": "22C", "tool_call_id": 5}),                                          # 8
        chat({"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{oops"}}]}),  # 9
        chat({"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "[1]"}}]}),   # 10
        chat({"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": {"a": 1}}}]}),  # 11
        chat({"role": "assistant", "tool_calls": []}),                                                        # 12
        chat({"role": "user", "content": "a", "name": 7}),                                                    # 13
        chat({"role": "user", "content": "a", "audio": {"id": "x"}}),                                         # 14
        chat({"role": "assistant", "tool_calls": [{**CALL, "type": "custom"}]}),                              # 15
        chat({"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f",
                                                                        "arguments": "[" * 100_000}}]}),      # 16
        chat({"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f",
                                                                        "arguments": "{\"a\": \"\\ud800\"}"}}]}),  # 17
    ]
    got = errors_by_line(tmp_path, [batch_line(f"x{i}", body) for i, body in enumerate(lines)])
    expected = {
        1: "messages[1].content[1] has type 'image_url'; only text parts are supported",
        2: "messages[1].content[0] has type 'input_audio'; only text parts are supported",
        3: "messages[1].content must be a string or a non-empty list of text parts, got an empty list",
        4: "messages[1].content[0] must be a text part",
        5: "messages[1].content[0].text must be a string, got null",
        6: "messages[1] has unsupported field 'tool_calls' (a user message takes content, name, role)",
        7: "messages[1].content must be a string or a non-empty list of text parts, got null",
        8: "messages[1].tool_call_id must be a non-empty string, got 5",
        9: "messages[1].tool_calls[0].function.arguments is not valid JSON",
        10: "messages[1].tool_calls[0].function.arguments must be a JSON object, got a list",
        11: "messages[1].tool_calls[0].function.arguments must be a string of JSON, got an object",
        12: "messages[1].tool_calls must be a list of 1 to 128 tool calls, got an empty list",
        13: "messages[1].name must be a non-empty string, got 7",
        14: "messages[1] has unsupported field 'audio'",
        15: "messages[1].tool_calls[0] must be {\"id\", \"type\": \"function\"",
        16: "messages[1].tool_calls[0].function.arguments is nested too deeply (the limit is 32 levels)",
        17: "messages[1].tool_calls[0].function.arguments contains an unpaired surrogate",
    }
    assert sorted(got) == sorted(expected)
    for line, fragment in expected.items():
        assert fragment in got[line], (line, got[line])


def test_text_parts_and_tool_arguments_count_towards_the_character_limit(tmp_path):
    limits = Limits(max_prompt_chars=10)
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "abcdef"}] * 2}]}
    call = {"messages": [{"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f",
                                                                                    "arguments": "{\"a\": 12345}"}}]}]}
    v = validate(write(tmp_path, [batch_line("p", parts), batch_line("c", call)]), limits)
    assert [(e.line, "characters of content in all; the limit is 10" in e.message) for e in v.errors] == [
        (1, True), (2, True)]


def test_body_fields_given_as_null_are_taken_as_left_out(tmp_path):
    lines = [
        batch_line("a", {"prompt": "Hi", "suffix": None, "best_of": 1, "echo": None}, url=COMPLETIONS),
        batch_line("b", {"prompt": "Hi", "best_of": 2, "n": 2}, url=COMPLETIONS),
        batch_line("c", {"messages": [{"role": "user", "content": "hi"}], "audio": None, "prediction": None,
                         "reasoning_effort": None, "function_call": None, "prompt_cache_key": "nightly",
                         "prompt_cache_retention": "24h", "safety_identifier": "u-1"}),
    ]
    v = validate(write(tmp_path, lines[:2]), Limits())
    assert v.errors == [] and v.num_requests == 2
    v = validate(write(tmp_path, lines[2:], "chat.jsonl"), Limits())
    assert v.errors == [] and v.num_requests == 1
    bad = errors_by_line(tmp_path, [
        batch_line("a", {"prompt": "Hi", "best_of": 3}, url=COMPLETIONS),
        batch_line("b", {"prompt": "Hi", "best_of": True}, url=COMPLETIONS),
        batch_line("c", {"prompt": "Hi", "suffix": "!"}, url=COMPLETIONS),
    ])
    assert "best_of = 3 is not supported: only best_of equal to n" in bad[1]
    assert "best_of = true is not supported" in bad[2]
    assert bad[3] == "unsupported field 'suffix'"
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert errors_by_line(tmp_path, [
        batch_line("d", {**chat, "best_of": 1}),   # not a chat field
        batch_line("e", {**chat, "functions": [{"name": "f", "parameters": {}}], "function_call": {"name": "f"}}),
        batch_line("f", {**chat, "verbosity": "low"}),
    ]) == {1: "unsupported field 'best_of'",
           2: "unsupported field 'function_call' (the legacy form of tool_choice: use tools and tool_choice); "
              "unsupported field 'functions' (the legacy form of tools: use tools and tool_choice)",
           3: "unsupported field 'verbosity'"}


def test_a_completions_prompt_may_be_a_list_of_texts_or_token_ids(tmp_path):
    lines = [
        batch_line("texts", {"prompt": ["Once upon", "The end"], "n": 2}, url=COMPLETIONS),
        batch_line("ids", {"prompt": [101, 102, 103]}, url=COMPLETIONS),
        batch_line("id-lists", {"prompt": [[101, 102], [7]]}, url=COMPLETIONS),
        batch_line("one", {"prompt": ["Hello"]}, url=COMPLETIONS),   # one text: the same request as "Hello"
        batch_line("echo", {"prompt": ["a", "b"], "echo": True}, url=COMPLETIONS),
    ]
    items = {item.id: item for _, item in iter_lines(write(tmp_path, lines), Limits())}
    texts = items["texts"]
    assert (texts.prompt, texts.prompts, texts.num_rows) == (None, ["Once upon", "The end"], 4)
    assert [texts.prompt_index(c) for c in range(4)] == [0, 0, 1, 1]   # OpenAI's order: i * n + j
    assert (items["ids"].prompts, items["id-lists"].prompts) == ([[101, 102, 103]], [[101, 102], [7]])
    assert (items["one"].prompt, items["one"].prompts, items["one"].num_rows) == ("Hello", None, 1)
    assert items["one"].to_dict()["prompt"] == "Hello" and "prompts" not in items["one"].to_dict()
    assert items["echo"].echo and items["echo"].prompts == ["a", "b"]
    got = errors_by_line(tmp_path, [
        batch_line("a", {"prompt": []}, url=COMPLETIONS),
        batch_line("b", {"prompt": ["x", 1]}, url=COMPLETIONS),
        batch_line("c", {"prompt": ["x", ""]}, url=COMPLETIONS),
        batch_line("d", {"prompt": [[1], []]}, url=COMPLETIONS),
        batch_line("e", {"prompt": [-1]}, url=COMPLETIONS),
        batch_line("f", {"prompt": ["x"] * 2049}, url=COMPLETIONS),
        batch_line("g", {"prompt": [[1, 2]], "echo": True}, url=COMPLETIONS),
    ])
    assert got == {
        1: "prompt must be a string, a list of strings or token ids, got an empty list",
        2: "prompt must be all strings, all token ids or all lists of token ids, not a mix",
        3: "prompt[1] must be a non-empty string, got ''",
        4: "prompt[1] is an empty list of token ids",
        5: "prompt[0] must be a token id (an integer >= 0), got -1",
        6: "prompt has 2049 items; at most 2048 are allowed (split it over several lines)",
        7: "echo needs prompts given as text (it puts their text before the answers), not token ids",
    }
