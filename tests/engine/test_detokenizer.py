"""IncrementalDetokenizer with the real (SmolLM2, byte-level BPE) tokenizer, through its streaming
decoder and through the windows a slow tokenizer gets."""
from __future__ import annotations

import random

import pytest

from pipeline.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer


class WithoutBackend:
    """The fast tokenizer seen as a slow one (no backend_tokenizer): the two-window path."""

    def __init__(self, tokenizer):
        self.encode, self.decode, self.eos_token_id = tokenizer.encode, tokenizer.decode, tokenizer.eos_token_id


@pytest.fixture(scope="module")
def fast_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module", params=["stream", "windows"])
def tokenizer(request, fast_tokenizer):
    """Each test twice: tokenizers' DecodeStream, and the windows a slow tokenizer gets."""
    return fast_tokenizer if request.param == "stream" else WithoutBackend(fast_tokenizer)


# A stop string that never appears: keeps the detokenizer incremental (without stop
# strings it decodes once, at flush).
NEVER = ["<never-appears>"]


def feed(detok: IncrementalDetokenizer, ids: list[int]) -> list[bool]:
    """add_token for each id, stopping (as the engine does) at the first stop string."""
    hits = []
    for t in ids:
        hits.append(detok.add_token(t))
        if hits[-1]:
            break
    return hits


TEXTS = [
    " héllo 世界 🙂",
    " 🙂🙂 日本語のテキスト",
    "Hello world, this is a test",
    "\n\n  two  spaces\tand a tab\n",
    " naïve café – “quotes” ½ €",
]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_full_decode(tokenizer, text):
    prompt_ids = tokenizer.encode("Say something:")
    out_ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, NEVER)
    seen = []
    for t in out_ids:
        assert detok.add_token(t) is False
        seen.append(detok.text)
        assert REPLACEMENT_CHAR not in detok.text      # partial characters are held back
    detok.flush()
    assert detok.text == tokenizer.decode(out_ids, skip_special_tokens=True) == text
    assert all(text.startswith(s) for s in seen)       # text only ever grows


@pytest.mark.parametrize("text", TEXTS + [" 世界", "Hi"])
def test_without_stop_strings_text_is_decoded_once_at_the_end(tokenizer, text):
    prompt_ids, out_ids = tokenizer.encode("Say something:"), tokenizer.encode(text)
    deferred, incremental = (IncrementalDetokenizer(tokenizer, prompt_ids, stop) for stop in ([], NEVER))
    for t in out_ids:
        assert deferred.add_token(t) is False and incremental.add_token(t) is False
    assert deferred.text == ""
    deferred.flush()
    incremental.flush()
    assert deferred.text == incremental.text == tokenizer.decode(out_ids, skip_special_tokens=True)


def test_multibyte_characters_really_span_tokens(tokenizer):
    # Guard for the test above: the CJK text and emoji are split into byte tokens that
    # cannot be decoded on their own, so the hold-back logic is exercised.
    ids = tokenizer.encode(" 🙂🙂 日本語のテキスト")
    assert any(REPLACEMENT_CHAR in tokenizer.decode([t]) for t in ids)


def test_first_word_keeps_its_leading_space(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hello"), NEVER)
    feed(detok, tokenizer.encode(" world"))
    assert detok.text == " world"


def test_special_tokens_are_skipped(tokenizer):
    ids = tokenizer.encode("Hi") + [tokenizer.eos_token_id] + tokenizer.encode(" there")
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("x"), [])
    feed(detok, ids)
    detok.flush()
    assert detok.text == "Hi there"


def test_flush_emits_a_trailing_incomplete_character(tokenizer):
    ids = tokenizer.encode(" 世界")
    partial = ids[:-1]
    assert tokenizer.decode(partial).endswith(REPLACEMENT_CHAR)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("x"), NEVER)
    feed(detok, partial)
    assert REPLACEMENT_CHAR not in detok.text
    detok.flush()
    assert detok.text.endswith(REPLACEMENT_CHAR)
    assert detok.text.startswith(" 世")


def test_stop_string_straddling_tokens_cuts_the_text(tokenizer):
    ids = tokenizer.encode("Hello world, this is a test")
    assert [tokenizer.decode([t]) for t in ids[:2]] == ["Hello", " world"]
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"), ["o wor"])
    assert detok.add_token(ids[0]) is False
    assert detok.text == "Hello"
    assert detok.add_token(ids[1]) is True        # "o wor" spans "Hello" and " world"
    assert detok.text == "Hell"


def test_earliest_stop_string_wins(tokenizer):
    ids = tokenizer.encode("Hello world, this is a test")
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"), ["world", "o w"])
    assert feed(detok, ids[:2]) == [False, True]
    assert detok.text == "Hell"


def test_stop_string_spanning_many_tokens(tokenizer):
    ids = tokenizer.encode("Hello world, this is a test")
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"), ["world, this is"])
    assert feed(detok, ids) == [False] * 4 + [True]   # found when " is" arrives
    assert detok.text == "Hello "


def test_stop_string_made_of_multibyte_characters(tokenizer):
    ids = tokenizer.encode(" héllo 世界 🙂")
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"), ["界 🙂"])
    assert feed(detok, ids) == [False] * (len(ids) - 1) + [True]
    assert detok.text == " héllo 世"


def test_stop_string_in_the_prompt_does_not_stop(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hello world"), ["world"])
    assert feed(detok, tokenizer.encode(" and more")) == [False, False]
    assert detok.text == " and more"


def test_stop_string_completed_by_held_back_text_is_cut_at_flush(tokenizer):
    # Token 17097 is a space plus the first byte of a CJK character: its text is held
    # back (it ends in an incomplete character) until flush() forces it out. A stop
    # string completed by that space must still be cut from the final text.
    ids = tokenizer.encode(" 🙂🙂 日本語")
    space_and_partial = next(t for t in ids if tokenizer.decode([t]).startswith(" ")
                             and tokenizer.decode([t]).endswith(REPLACEMENT_CHAR)
                             and len(tokenizer.decode([t])) == 2)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"), ["b "])
    assert feed(detok, tokenizer.encode("ab") + [space_and_partial]) == [False] * (len(tokenizer.encode("ab")) + 1)
    assert detok.text == "ab"                     # the space is still held back
    assert detok.flush() is True
    assert detok.text == "a"


def test_the_stream_and_the_windows_give_the_same_text_token_by_token(fast_tokenizer):
    """Random token ids (byte fragments, special tokens, odd spacing) and real text: the
    same text after every token, with the same held-back characters, then at flush."""
    rng = random.Random(0)
    prompt_ids = fast_tokenizer.encode("Say something:")
    cases = [[rng.randrange(len(fast_tokenizer)) for _ in range(200)] for _ in range(5)]
    cases += [fast_tokenizer.encode(text) for text in TEXTS]
    for ids in cases:
        stream = IncrementalDetokenizer(fast_tokenizer, prompt_ids, NEVER)
        windows = IncrementalDetokenizer(WithoutBackend(fast_tokenizer), prompt_ids, NEVER)
        assert stream._stream is not None and windows._stream is None
        for t in ids:
            assert stream.add_token(t) == windows.add_token(t)
            assert stream.text == windows.text
        stream.flush(), windows.flush()
        assert stream.text == windows.text
