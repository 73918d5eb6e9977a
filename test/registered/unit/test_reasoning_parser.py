"""The reasoning parsers on hand-written replies, whole and streamed at every split point.

Expected splits are written out by hand: the reasoning (without the whitespace around it), the
content, and the raw text of the tags (`markup`); the three always add up to the reply.
"""

from __future__ import annotations

import pytest

from sglang.srt.entrypoints.openai.reasoning_parser import REASONING_PARSERS, ReasoningStream


def split(parser: str, chunks: list[str]) -> tuple[str, str, str]:
    """(reasoning, content, markup) of a reply fed in `chunks`, checking the event order."""
    stream = ReasoningStream(REASONING_PARSERS[parser])
    events = []
    for c in chunks:
        events += stream.feed(c)
    events += stream.finish()
    kinds = [k for k, _ in events if k != "markup"]
    assert kinds == sorted(kinds, key=lambda k: k == "content"), "reasoning after content"
    text = {k: "".join(t for kk, t in events if kk == k) for k in ("reasoning", "content", "markup")}
    return text["reasoning"], text["content"], text["markup"]


CASES = [
    ("qwen3", "<think>\nThe user wants a number.\n</think>\n\n42", ("The user wants a number.", "42")),
    ("qwen3", "<think>\n\n</think>\n\nNo thinking here.", ("", "No thinking here.")),
    ("qwen3", "Just an answer, no block.", ("", "Just an answer, no block.")),
    ("qwen3", "An answer that mentions </think> and <think>.", ("", "An answer that mentions </think> and <think>.")),
    ("qwen3", "\n<think>a\nb</think>c", ("a\nb", "c")),
    ("qwen3", "<think>cut off before the end", ("cut off before the end", "")),
    ("qwen3", "<think>ends in a partial tag </thi", ("ends in a partial tag </thi", "")),
    ("qwen3", "<thin", ("", "<thin")),
    ("qwen3", "<think>x</think>", ("x", "")),
    ("deepseek-r1", "Okay, the user asks for 2+2.\n</think>\n\nIt is 4.", ("Okay, the user asks for 2+2.", "It is 4.")),
    ("deepseek-r1", "<think>\nWith its own tag.\n</think>\nYes.", ("With its own tag.", "Yes.")),
    ("deepseek-r1", "Never closed, so all of it is reasoning.", ("Never closed, so all of it is reasoning.", "")),
    ("deepseek-r1", "</think>Straight to the answer.", ("", "Straight to the answer.")),
    ("qwen3-thinking", "Thinking...\n</think>\n\nDone.", ("Thinking...", "Done.")),
]


@pytest.mark.parametrize("parser,text,expected", CASES, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(CASES)])
def test_whole_and_streamed(parser: str, text: str, expected: tuple[str, str]) -> None:
    whole = split(parser, [text])
    assert whole[:2] == expected
    assert len(whole[0]) + len(whole[1]) + len(whole[2]) == len(text)
    for k in range(len(text) + 1):
        assert split(parser, [text[:k], text[k:]]) == whole, k
    assert split(parser, list(text)) == whole


def test_streamed_reasoning_is_not_held_longer_than_needed() -> None:
    stream = ReasoningStream(REASONING_PARSERS["qwen3"])
    assert stream.feed("<thi") == []
    assert stream.feed("nk>\nStep one") == [("markup", "<think>\n"), ("reasoning", "Step one")]
    assert stream.feed(".\n</th") == [("reasoning", ".")]  # the newline and the tag's start wait
    assert stream.feed("ink>\n\nThe answer") == [("markup", "\n</think>\n\n"), ("content", "The answer")]
    assert not stream.in_reasoning
    assert stream.finish() == []
