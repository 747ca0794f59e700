"""pipeline/prompts.py: a batch of requests tokenized together gives each the ids it gets
alone, and a request that cannot be tokenized fails alone; the engines add requests in
batches (generate, EngineLoop) with the same outcome as one at a time."""
from __future__ import annotations

import pytest

from pipeline import Engine, EngineConfig, Request, SamplingParams
from pipeline.models.loader import load_tokenizer
from pipeline.prompts import _rust_backend, encoded_texts, prompt_token_ids, prompts_token_ids

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def mixed_requests() -> list[Request]:
    return [Request("raw", prompt="The capital of France is"),
            Request("chat", messages=[{"role": "user", "content": "Name a colour. é ☃"}]),
            Request("ids", prompt_token_ids=[5, 6, 7]),
            Request("tools", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[TOOL]),
            Request("raw2", prompt="  leading spaces and\nnew lines\t"),
            Request("empty", prompt="")]


def alone(tokenizer, r: Request) -> list[int]:
    """The request's ids from the tokenizer's one-text calls, and from prompt_token_ids (the same)."""
    if r.prompt_token_ids is not None:
        ids = list(r.prompt_token_ids)
    elif r.messages is not None:
        text = tokenizer.apply_chat_template(r.messages, tools=r.tools, tokenize=False, add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        ids = tokenizer.encode(r.prompt)
    assert prompt_token_ids(tokenizer, prompt=r.prompt, messages=r.messages, tools=r.tools,
                            token_ids=r.prompt_token_ids) == ids
    return ids


@pytest.mark.parametrize("model", ["bundled", "minilm"])
def test_a_batch_gives_each_request_the_ids_it_gets_alone(model, bundled_model_dir, minilm_dir):
    tokenizer = load_tokenizer(bundled_model_dir if model == "bundled" else minilm_dir)
    requests = mixed_requests() if model == "bundled" else [r for r in mixed_requests() if r.messages is None]
    together = prompts_token_ids(tokenizer, requests)
    assert together == [alone(tokenizer, r) for r in requests]
    assert prompts_token_ids(tokenizer, []) == []


TRICKY_TEXTS = ["The capital of France is", "", "  leading spaces\tand\nlines ", "é ☃ 中文 naïve",
                "<|im_start|>user\nhi<|im_end|>", "[CLS] a [SEP] [MASK] b", "word " * 300]


@pytest.mark.parametrize("model", ["bundled", "minilm"])
@pytest.mark.parametrize("split_special", [False, True])
def test_texts_encoded_at_the_rust_backend_get_the_librarys_ids(model, split_special, bundled_model_dir, minilm_dir):
    """encoded_texts calls a fast tokenizer's Rust backend itself: the ids are the library's,
    on a tokenizer fresh from its files (all-MiniLM-L6-v2's tokenizer.json pads and truncates
    to 128, which the library turns off per call), special tokens split or not."""
    model_dir = bundled_model_dir if model == "bundled" else minilm_dir
    fresh, reference = load_tokenizer(model_dir), load_tokenizer(model_dir)
    assert _rust_backend(type(fresh))
    if model == "minilm":
        assert fresh.backend_tokenizer.padding is not None and fresh.backend_tokenizer.truncation is not None
    fresh.split_special_tokens = reference.split_special_tokens = split_special
    for special in (True, False):
        got = encoded_texts(fresh, TRICKY_TEXTS, special)
        assert got == reference(TRICKY_TEXTS, add_special_tokens=special)["input_ids"]
        assert len(got[-1]) >= 300 and len(got[1]) == (2 if special and model == "minilm" else 0)
    special_token, text = ("<|im_start|>", 4) if model == "bundled" else ("[MASK]", 5)
    assert (reference.convert_tokens_to_ids(special_token) not in got[text]) == split_special   # or its pieces


def test_a_tokenizer_with_its_own_encoding_is_called_as_the_library_calls_it(minilm_dir):
    """A tokenizer class that changes how texts are encoded keeps its own way: not the backend's."""
    tokenizer = load_tokenizer(minilm_dir)

    class Signed(type(tokenizer)):
        def _encode_plus(self, text, *args, **kwargs):
            return super()._encode_plus([t + " signed" for t in text], *args, **kwargs)

    signed = encoded_texts(tokenizer, ["hello world signed"], False)
    tokenizer.__class__ = Signed
    assert not _rust_backend(Signed)
    assert encoded_texts(tokenizer, ["hello world"], False) == signed


def test_a_request_that_cannot_be_tokenized_fails_alone(bundled_model_dir):
    tokenizer = load_tokenizer(bundled_model_dir)
    requests = [Request("ok", prompt="hello"), Request("bad", messages=[{"role": "user"}]),   # no content
                Request("ok2", messages=[{"role": "user", "content": "hi"}])]
    ids = prompts_token_ids(tokenizer, requests)
    assert isinstance(ids[1], Exception)
    assert ids[0] == alone(tokenizer, requests[0]) and ids[2] == alone(tokenizer, requests[2])


def test_chats_rendered_together_keep_their_own_place_and_options(bundled_model_dir):
    """Chats without tools are rendered in one template call per reasoning_effort: interleaved
    with the rest, each still gets the ids it gets alone, and a bad one fails alone."""
    tokenizer = load_tokenizer(bundled_model_dir)
    requests = []
    for i in range(9):
        chat = [{"role": "user", "content": f"question {i}: " + "word " * i}]
        requests.append(Request(f"c{i}", messages=chat, reasoning_effort=[None, "none", "high"][i % 3]))
        if i % 4 == 0:
            requests.append(Request(f"raw{i}", prompt=f"raw {i}"))
    requests.insert(5, Request("bad", messages=[{"role": "user"}]))   # no content: its template call raises
    requests.insert(2, Request("empty", messages=[]))   # refused by the template, as alone
    ids = prompts_token_ids(tokenizer, requests)
    assert isinstance(ids[2], Exception) and isinstance(ids[6], Exception)
    for r, got in zip(requests, ids):
        if r.id in ("bad", "empty"):
            continue
        want = prompt_token_ids(tokenizer, prompt=r.prompt, messages=r.messages,
                                reasoning_effort=r.reasoning_effort)
        assert got == want, r.id
        if r.messages is not None:
            assert tokenizer.decode(got).count(r.messages[0]["content"].strip()) == 1, r.id


def test_engine_adds_a_batch_as_it_adds_one_at_a_time(tiny_model_dir):
    engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32", kv_cache_gib=0.05))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    requests = [Request("a", prompt="one two three", params=params),
                Request("bad", messages=[{"role": "user"}], params=params),
                Request("c", messages=[{"role": "user", "content": "four"}], params=params),
                Request("long", prompt_token_ids=[9] * 100_000, params=params)]
    errors = engine.add_requests(requests)
    assert [len(e) for e in errors] == [0, 1, 0, 1]
    assert errors[1][0].error.startswith("tokenisation failed") and "maximum model length" in errors[3][0].error
    queued = {s.request_id: s.prompt_token_ids for s in engine.scheduler.waiting}
    assert queued == {"a": engine.tokenize(requests[0]), "c": engine.tokenize(requests[2])}
    together = {o.id: o.token_ids for o in engine.generate([])}   # runs what is queued
    for r in (requests[0], requests[2]):
        assert engine.add_request(r) == []
    one_by_one = {o.id: o.token_ids for o in engine.generate([])}
    assert together == one_by_one and set(together) == {"a", "c"}


# A chat template that shows names, tool calls (their arguments as JSON) and tool results.
TOOL_TEMPLATE = ("{% for m in messages %}<{{ m.role }}{% if m.name %} {{ m.name }}{% endif %}>{{ m.content }}"
                 "{% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments | tojson }}]"
                 "{% endfor %}{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}{% endfor %}<assistant>")


def test_an_openai_tool_conversation_reaches_the_template_as_it_expects(bundled_model_dir):
    """Messages checked by the job's validation (jobs.input.prompt_checks) render with each call's
    arguments as an object (a template's tojson of the OpenAI string would quote it again);
    a template that never reads tool_calls fails the request instead of dropping the calls."""
    from jobs.input.prompt_checks import request_inputs

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
    problems = []
    messages = request_inputs({"messages": [
        {"role": "user", "name": "bob", "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "in Paris?"}]},
        {"role": "assistant", "content": None, "tool_calls": [call], "refusal": None},
        {"role": "tool", "tool_call_id": "call_1", "content": "22C"}]}, 10_000, problems)["messages"]
    assert problems == []
    tokenizer = load_tokenizer(bundled_model_dir)
    smollm_template, tokenizer.chat_template = tokenizer.chat_template, TOOL_TEMPLATE
    ids = prompt_token_ids(tokenizer, messages=messages)
    assert tokenizer.decode(ids) == ('<user bob>Weather\nin Paris?<assistant>[get_weather {"city": "Paris"}]'
                                     '<tool>22C(call_1)<assistant>')
    tokenizer.chat_template = smollm_template   # SmolLM2's shows role and content only
    with pytest.raises(ValueError, match="chat template does not show an assistant's tool_calls"):
        prompt_token_ids(tokenizer, messages=messages)
    without_calls = [m for m in messages if "tool_calls" not in m]
    assert prompt_token_ids(tokenizer, messages=without_calls) == alone(tokenizer, Request("r", messages=without_calls))
