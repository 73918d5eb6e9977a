"""The tool-call parsers on hand-written model outputs, whole and streamed.

Each case is a reply as a model writes it and what the server must make of it: the content and the
calls, written out by hand. Every reply is also fed in two chunks split at every character (inside
the markers, inside the JSON, inside whitespace), one character at a time, and in seeded random
chunkings; the streamed events must add up to the whole reply's parse.
"""

from __future__ import annotations

import json
import random
from typing import Optional, Union

import pytest

from sglang.srt.entrypoints.openai.tool_parsers import TOOL_CALL_PARSERS, ParsedCall, ToolCallStream, tool_call_format

NAMES = frozenset({"get_weather", "get_time"})


def weather(city: str) -> ParsedCall:
    return ParsedCall("get_weather", json.dumps({"city": city}))


TIME = ParsedCall("get_time", "{}")
Expected = list[Union[str, ParsedCall]]  # content pieces and calls, in order


def parse(parser: str, chunks: list[str], max_calls: Optional[int] = None) -> Expected:
    stream = ToolCallStream(tool_call_format(parser), NAMES, max_calls)
    events: Expected = []
    for c in chunks:
        events += stream.feed(c)
    events += stream.finish()
    merged: Expected = []
    for e in events:  # the text of consecutive chunks is one piece of content
        if isinstance(e, str) and merged and isinstance(merged[-1], str):
            merged[-1] += e
        else:
            merged.append(e)
    return merged


def chunkings(text: str) -> list[list[str]]:
    out = [[text[:k], text[k:]] for k in range(len(text) + 1)]
    out.append(list(text))
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8)))) if len(text) > 1 else []
        out.append([text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])
    return out


HERMES_CALL_PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
HERMES_CALL_TIME = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'

CASES: list[tuple[str, str, Expected]] = [
    # ---- hermes / qwen25
    ("qwen25", "  Hello there.\n\n", ["  Hello there.\n\n"]),  # no call: unchanged, whitespace included
    ("qwen25", "Let me check.\n" + HERMES_CALL_PARIS, ["Let me check.", weather("Paris")]),
    ("qwen25", HERMES_CALL_PARIS + "\n" + HERMES_CALL_TIME + "\n", [weather("Paris"), TIME]),
    ("qwen25", HERMES_CALL_PARIS + "\n\nIt is sunny.", [weather("Paris"), "\n\nIt is sunny."]),
    ("qwen25", "Before\n" + HERMES_CALL_PARIS + "\nAfter", ["Before", weather("Paris"), "\nAfter"]),
    # a name outside the tools, broken JSON, no name: the text stays content, markup and all
    ("qwen25", 'Hi\n<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>',
     ['Hi\n<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>']),
    ("qwen25", '<tool_call>\n{"name": "get_time", "arguments": {]}\n</tool_call> ok',
     ['<tool_call>\n{"name": "get_time", "arguments": {]}\n</tool_call> ok']),
    ("qwen25", '<tool_call>{"arguments": {}}</tool_call>', ['<tool_call>{"arguments": {}}</tool_call>']),
    ("qwen25", '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',
     ['<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>']),
    # a call the reply ended inside: complete JSON is a call, incomplete JSON is content
    ("qwen25", '<tool_call>\n{"name": "get_time", "arguments": {}}', [TIME]),
    ("qwen25", '<tool_call>\n{"name": "get_time", "argum', ['<tool_call>\n{"name": "get_time", "argum']),
    # arguments as a JSON string (some fine-tunes), absent arguments, non-ASCII, markup in a value
    ("qwen25", '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Z\\u00fcrich\\"}"}</tool_call>',
     [ParsedCall("get_weather", '{"city": "Zürich"}')]),
    ("qwen25", '<tool_call>{"name": "get_time"}</tool_call>', [TIME]),
    ("qwen25", '<tool_call>{"name": "get_weather", "arguments": {"city": "<tool_call> \\"}\\" ["}}</tool_call>',
     [ParsedCall("get_weather", json.dumps({"city": '<tool_call> "}" ['}, ensure_ascii=False))]),
    ("qwen25", "A partial marker at the end: <tool_ca", ["A partial marker at the end: <tool_ca"]),
    ("qwen25", "<tool_call", ["<tool_call"]),
    # ---- llama3 (Llama 3.1 / 3.2 JSON)
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}', [weather("Paris")]),
    ("llama3", '\n\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', [weather("Paris")]),
    ("llama3", '<|python_tag|>{"name": "get_time", "parameters": {}}', [TIME]),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}',
     [weather("Paris"), TIME]),
    ("llama3", 'Sure.<|python_tag|>{"name": "get_time", "parameters": {}}', ["Sure.", TIME]),
    ("llama3", '{"answer": 42, "name": "nope"}', ['{"answer": 42, "name": "nope"}']),  # a JSON answer
    ("llama3", '{"name": "get_time", "parameters": {}}; {"name": "rm", "parameters": {}}',
     ['{"name": "get_time", "parameters": {}}; {"name": "rm", "parameters": {}}']),  # all or nothing
    ("llama3", '<|python_tag|>brave_search.call(query="x")', ['<|python_tag|>brave_search.call(query="x")']),
    ("llama3", 'The JSON {"name": "get_time", "parameters": {}} is inline.',
     ['The JSON {"name": "get_time", "parameters": {}} is inline.']),  # only at the start
    ("llama3", '{"name": "get_time", "parameters": {}} and more', [TIME, " and more"]),
    ("llama3", '{"name": "get_time", "parameters": {', ['{"name": "get_time", "parameters": {']),
    # ---- mistral
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_time", "arguments": {}}]', [weather("Paris"), TIME]),
    ("mistral", 'Sure.\n[TOOL_CALLS][{"name": "get_time", "arguments": {}}]', ["Sure.", TIME]),
    ("mistral", '[TOOL_CALLS] {"name": "get_time", "arguments": {}}', [TIME]),
    ("mistral", '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}, {"name": "x", "arguments": {}}]',
     ['[TOOL_CALLS] [{"name": "get_time", "arguments": {}}, {"name": "x", "arguments": {}}]']),
    ("mistral", "[TOOL_CALLS] no JSON here", ["[TOOL_CALLS] no JSON here"]),
    ("mistral", '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}', ['[TOOL_CALLS] [{"name": "get_time", "arguments": {}}']),
    ("mistral", "[TOOL_CALLS] []", ["[TOOL_CALLS] []"]),
    # ---- mistral, tokenizer v11+: [TOOL_CALLS]name[ARGS]{...}, each call with its own marker
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', [weather("Paris")]),
    ("mistral", 'Sure.\n[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
     ["Sure.", weather("Paris"), TIME]),
    ("mistral", '[TOOL_CALLS] get_time [ARGS] {} Done.', [TIME, " Done."]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "[TOOL_CALLS]x[ARGS]{"}', [weather("[TOOL_CALLS]x[ARGS]{")]),
    ("mistral", "[TOOL_CALLS]launch[ARGS]{}", ["[TOOL_CALLS]launch[ARGS]{}"]),  # not one of the tools
    ("mistral", "[TOOL_CALLS]get_time[ARGS]{", ["[TOOL_CALLS]get_time[ARGS]{"]),  # cut off
    ("mistral", "[TOOL_CALLS]get_time[ARGS]", ["[TOOL_CALLS]get_time[ARGS]"]),
    ("mistral", "[TOOL_CALLS]get_time", ["[TOOL_CALLS]get_time"]),
    ("mistral", "[TOOL_CALLS]get_time[ARGS][1]", ["[TOOL_CALLS]get_time[ARGS][1]"]),
    ("mistral", '[TOOL_CALLS]get_time[ARGS]{"a": ]}', ['[TOOL_CALLS]get_time[ARGS]{"a": ]}']),
    ("mistral", "[TOOL_CALLS]get_time is a tool", ["[TOOL_CALLS]get_time is a tool"]),
    ("mistral", '[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]rm[ARGS]{}', [TIME, "[TOOL_CALLS]rm[ARGS]{}"]),
]


@pytest.mark.parametrize("parser,text,expected", CASES, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(CASES)])
def test_whole_and_streamed(parser: str, text: str, expected: Expected) -> None:
    assert parse(parser, [text]) == expected
    for chunks in chunkings(text):
        assert parse(parser, chunks) == expected, chunks


@pytest.mark.parametrize("parser,text,expected", CASES, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(CASES)])
def test_every_cut_of_a_reply_parses_the_same_streamed(parser: str, text: str, expected: Expected) -> None:
    """A reply cut anywhere (max_tokens, a broken model) never raises, streamed or not, and its
    stream adds up to its whole parse."""
    rng = random.Random(len(text))
    for end in range(len(text) + 1):
        cut = text[:end]
        whole = parse(parser, [cut])
        assert parse(parser, list(cut)) == whole, cut
        cuts = sorted(rng.sample(range(1, end), min(end - 1, 4))) if end > 1 else []
        assert parse(parser, [cut[a:b] for a, b in zip([0] + cuts, cuts + [end])]) == whole, cut


@pytest.mark.parametrize("parser", ["qwen25", "llama3", "mistral"])
def test_a_reply_without_calls_is_passed_through(parser: str) -> None:
    for text in ["", "\n", "Plain text, with {braces} and [brackets]; and <tags>.", "  two\n\nparagraphs  \n"]:
        assert "".join(parse(parser, [text])) == text
        assert "".join(parse(parser, list(text))) == text


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    text = "On it.\n" + HERMES_CALL_PARIS + "\n" + HERMES_CALL_TIME
    for chunks in chunkings(text):
        assert parse("qwen25", chunks, max_calls=1) == ["On it.", weather("Paris")]


def test_text_before_a_call_streams_before_the_call_is_complete() -> None:
    stream = ToolCallStream(tool_call_format("qwen25"), NAMES)
    assert stream.feed("Let me check") == ["Let me check"]
    assert stream.feed(".\n<tool") == ["."]  # the newline and the marker's start are held back
    assert stream.feed('_call>\n{"name": "get_weather", "arguments": {"city": "Pa') == []
    assert stream.feed('ris"}}\n</tool_call>') == [weather("Paris")]
    assert stream.finish() == []


def test_mistral_named_calls_stream_each_as_it_closes() -> None:
    stream = ToolCallStream(tool_call_format("mistral"), NAMES)
    assert stream.feed("Sure.[TOOL_CALLS]get_wea") == ["Sure."]
    assert stream.feed('ther[ARGS]{"city": "Pa') == []
    assert stream.feed('ris"}[TOOL_CALLS]get_time[AR') == [weather("Paris")]
    assert stream.feed("GS]{}") == [TIME]
    assert stream.finish() == []
    # Text after the marker that cannot become a tool's name is content at once, not held.
    stream = ToolCallStream(tool_call_format("mistral"), NAMES)
    assert stream.feed("[TOOL_CALLS]hello") == ["[TOOL_CALLS]hello"]


def test_a_long_call_section_is_scanned_in_linear_time() -> None:
    # 20k one-character chunks of an argument: rescanning the section from its start on every
    # chunk would take ~2e8 steps; this finishes in well under a second.
    import time

    stream = ToolCallStream(tool_call_format("mistral"), NAMES)
    start = time.monotonic()
    stream.feed('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "')
    for _ in range(20000):
        stream.feed("a")
    assert stream.feed('"}}]') == [weather("a" * 20000)]
    assert time.monotonic() - start < 5


def test_parser_names() -> None:
    assert {"qwen25", "hermes", "llama3", "mistral"} <= set(TOOL_CALL_PARSERS)
    assert tool_call_format("qwen25").start_markers == tool_call_format("hermes").start_markers == ("<tool_call>",)
