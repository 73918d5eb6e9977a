"""Incremental detokenisation and stop-string trimming (managers/detokenizer.py)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from server_helpers import tiny_checkpoint
from sglang.srt.managers.detokenizer import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    find_stop_string,
    longest_partial_stop,
    token_bytes,
    visible_text,
)
from sglang.srt.entrypoints.openai.serving_completions import top_logprobs_entry

TEXT = "Mira said: héllo wörld, 日本語 and 🙂 emoji; the boats were red."


@pytest.fixture(scope="module")
def tokenizer():
    # A byte-level BPE trained on English: non-ASCII characters split over several tokens.
    return AutoTokenizer.from_pretrained(tiny_checkpoint("qwen3", seed=0))


def test_streamed_text_never_breaks_a_character(tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    pieces, partial_seen = [], False
    for i, tid in enumerate(ids):
        partial_seen |= tokenizer.decode(ids[: i + 1]).endswith(REPLACEMENT_CHAR)
        piece = detok.add([tid])
        assert REPLACEMENT_CHAR not in piece
        pieces.append(piece)
    pieces.append(detok.flush())
    assert partial_seen, "the text should contain characters split across tokens"
    assert "".join(pieces) == detok.text == tokenizer.decode(ids) == TEXT


def test_one_shot_equals_streamed(tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    one = IncrementalDetokenizer(tokenizer)
    one.add(ids)
    one.flush()
    streamed = IncrementalDetokenizer(tokenizer)
    for k in range(0, len(ids), 3):
        streamed.add(ids[k : k + 3])
    streamed.flush()
    assert one.text == streamed.text == TEXT


def test_incomplete_character_is_flushed_at_the_end(tokenizer) -> None:
    ids = tokenizer.encode("ab🙂", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    detok.add(ids[:-1])
    assert not detok.text.endswith(REPLACEMENT_CHAR)
    detok.flush()
    assert detok.text.endswith(REPLACEMENT_CHAR)  # the truncated emoji, reported as is


def test_special_tokens_are_skipped(tokenizer) -> None:
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode("Hi there", add_special_tokens=False) + [eos]
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    for t in ids:
        detok.add([t])
    detok.flush()
    assert detok.text == "Hi there"


def test_partial_stop_suffix() -> None:
    assert longest_partial_stop("hello wo", ["world"]) == 2
    assert longest_partial_stop("hello", ["world"]) == 0
    assert longest_partial_stop("abc<|", ["<|end|>", "c<"]) == 2
    assert longest_partial_stop("x", ["x"]) == 0  # a complete stop is not a partial one


def test_visible_text_cuts_and_holds_back() -> None:
    stops = ["STOP", "\n\n"]
    assert visible_text("one two ST", stops, finished=False) == "one two "
    assert visible_text("one two ST", stops, finished=True) == "one two ST"
    assert visible_text("a STOP b STOP", stops, finished=True) == "a "
    assert visible_text("a\n\nb", stops, finished=False) == "a"
    assert visible_text("a STOP b", stops, finished=True, trim_stop=False) == "a STOP b"


def test_stop_strings_within_the_protected_text_do_not_count() -> None:
    """min_new_tokens: a stop string ending in the text of the first tokens does not count; one
    beginning there and ending after it does, as does a later occurrence."""
    stops = ["STOP"]
    assert visible_text("a STOP b STOP c", stops, finished=True, protected=6) == "a STOP b "
    assert visible_text("a STOP b STOP c", stops, finished=True, protected=5) == "a "  # ends at 6 > 5
    assert visible_text("a STOP b", stops, finished=True, protected=8) == "a STOP b"
    assert find_stop_string("xx STOP", stops, protected=7) is None
    assert find_stop_string("xx STOP", stops, protected=6) == "STOP"


def test_streamed_prefixes_are_prefixes_of_the_final_text() -> None:
    stops = ["END!", "xyz"]
    full = "some words then EN and END! trailing"
    seen = []
    for k in range(1, len(full) + 1):
        seen.append(visible_text(full[:k], stops, finished=False))
    final = visible_text(full, stops, finished=True)
    assert final == "some words then EN and "
    for s in seen:
        assert final.startswith(s)
    assert seen[-1] == final


def test_find_stop_string_prefers_the_earliest() -> None:
    assert find_stop_string("abc stop1 stop2", ["stop2", "stop1"]) == "stop1"
    assert find_stop_string("nothing", ["stop"]) is None


def test_token_bytes_are_the_raw_utf8_pieces(tokenizer) -> None:
    """OpenAI's `bytes` of a logprob entry: a token holding part of a character gives its raw
    bytes (not U+FFFD's), so the bytes of a text's tokens join to the text's UTF-8."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    texts = [tokenizer.decode([t]) for t in ids]
    assert any(REPLACEMENT_CHAR in t for t in texts)  # the case that matters occurs
    joined = b"".join(bytes(token_bytes(t, tokenizer.convert_ids_to_tokens(i))) for t, i in zip(texts, ids))
    assert joined == TEXT.encode("utf-8")
    # SentencePiece's byte fallback, and a whole token without a vocabulary piece.
    assert token_bytes(REPLACEMENT_CHAR, "<0xE6>") == [0xE6]
    assert token_bytes("hé", None) == list("hé".encode())


def test_top_logprobs_keep_the_likeliest_of_tokens_with_one_text(tokenizer) -> None:
    ids = tokenizer.encode("日本", add_special_tokens=False)
    partial = [i for i in ids if tokenizer.decode([i]) == REPLACEMENT_CHAR][:2]
    assert len(partial) == 2
    top = [(-0.25, partial[0], None), (-2.5, partial[1], None), (-3.0, ids[-1], None)]
    entry = top_logprobs_entry(top, lambda t: tokenizer.decode([t]))
    assert entry[REPLACEMENT_CHAR] == -0.25
