"""pipeline.reasoning: which tokenizers think, where a think block opens, and an output split
into reasoning and answer on the token sequences Qwen3 and DeepSeek-R1 produce; the
thinking switch reaching the chat template (pipeline.prompts)."""
from __future__ import annotations

import pytest

from pipeline.models.loader import load_tokenizer
from pipeline.prompts import prompt_token_ids
from pipeline.reasoning import ThinkTags, template_options
from reasoning_helpers import R1_CHAT_TEMPLATE, make_tiny_qwen3

ASK = [{"role": "user", "content": "Why?"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory, bundled_model_dir):
    return load_tokenizer(make_tiny_qwen3(tmp_path_factory.mktemp("qwen3-tokenizer"), bundled_model_dir))


def output(tokenizer, text: str) -> tuple[str, list[int]]:
    """A model's output text and its tokens (the tags single tokens, as a model emits them)."""
    return text, tokenizer.encode(text, add_special_tokens=False)


def test_only_a_template_and_vocabulary_with_think_tags_think(tokenizer, bundled_model_dir):
    tags = ThinkTags.of(tokenizer)
    assert (tags.start_id, tags.end_id) == tuple(tokenizer.convert_tokens_to_ids(["<think>", "</think>"]))
    assert ThinkTags.of(load_tokenizer(bundled_model_dir)) is None   # SmolLM2: no tags in its template
    tokenizer.chat_template, template = R1_CHAT_TEMPLATE, tokenizer.chat_template
    try:
        assert ThinkTags.of(tokenizer) is not None
        tokenizer.chat_template = "{{ messages[0].content }}"
        assert ThinkTags.of(tokenizer) is None
    finally:
        tokenizer.chat_template = template


def test_the_switch_reaches_qwen3s_template(tokenizer):
    assert template_options(None) == {}
    assert template_options("none") == {"enable_thinking": False, "reasoning_effort": "none"}
    assert template_options("minimal")["enable_thinking"] is True
    off, on, default = (prompt_token_ids(tokenizer, messages=ASK, reasoning_effort=e) for e in ("none", "low", None))
    assert on == default and off == on + tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False)
    tags = ThinkTags.of(tokenizer)
    assert tags.opened_by(off) is False and tags.opened_by(on) is False
    assert tags.opened_by(on + [tags.start_id]) is True
    assert tags.opened_by(on + [tags.start_id, 5, tags.end_id]) is False


def test_qwen3_outputs_split(tokenizer):
    tags = ThinkTags.of(tokenizer)
    text, ids = output(tokenizer, "<think>\nLet me see.\nYes.\n</think>\n\nThe answer.")
    assert tags.split(text, ids, False) == ("Let me see.\nYes.", "The answer.", ids.index(tags.end_id) + 1)
    text, ids = output(tokenizer, "<think>\n\n</think>\n\nAt once.")   # an empty block
    assert tags.split(text, ids, False) == ("", "At once.", 3)
    text, ids = output(tokenizer, "<think>\nstill thinking when max_tokens came")
    assert tags.split(text, ids, False) == ("still thinking when max_tokens came", "", len(ids))
    text, ids = output(tokenizer, "No block: all answer </think> even so.")   # thinking off, or a grammar
    assert tags.split(text, ids, False) == (None, text, 0)


def test_deepseek_r1_outputs_split_without_an_opening_tag(tokenizer):
    tags = ThinkTags.of(tokenizer)
    text, ids = output(tokenizer, "Hmm, blue.</think>Rayleigh scattering.")
    assert tags.split(text, ids, True) == ("Hmm, blue.", "Rayleigh scattering.", ids.index(tags.end_id) + 1)
    text, ids = output(tokenizer, "Hmm, and on")
    assert tags.split(text, ids, True) == ("Hmm, and on", "", len(ids))
    text, ids = output(tokenizer, "\n<think>\nOpened again.</think>Done.")
    assert tags.split(text, ids, True) == ("Opened again.", "Done.", ids.index(tags.end_id) + 1)


def test_a_closing_tag_spelled_in_pieces_counts_what_the_answer_does_not_take(tokenizer):
    tags = ThinkTags.of(tokenizer)
    pieces = tokenizer.encode("Hmm.", add_special_tokens=False) + [
        tokenizer.convert_tokens_to_ids(t) for t in tokenizer.tokenize("</") + tokenizer.tokenize("think>")]
    answer = tokenizer.encode("Fine.", add_special_tokens=False)
    text = tokenizer.decode(pieces + answer)
    assert tags.end_id not in pieces and "</think>" in text
    assert tags.split(text, pieces + answer, True) == ("Hmm.", "Fine.", len(pieces))
