"""The tool-call parsers on hand-written model outputs, whole and streamed.

Each case is a reply as a model writes it and what the server must make of it: the content and the
calls, written out by hand. Every reply is also fed in two chunks split at every character (inside
the markers, inside the JSON, inside whitespace), one character at a time, and in seeded random
chunkings; the streamed events (a streamed call's name and argument pieces put together) must add
up to the whole reply's parse. Every prefix of every reply (a reply cut anywhere) must parse, whole
and streamed, without raising and to the same result.
"""

from __future__ import annotations

import json
import random
import sys
from typing import Optional, Union

import pytest

from sglang.srt.entrypoints.openai.tool_parsers import (
    TOOL_CALL_PARSERS,
    CallArguments,
    CallStart,
    ParsedCall,
    ToolCallStream,
    tool_call_format,
)

NAMES = frozenset({"get_weather", "get_time"})
# The request's tools, for the formats that type arguments by their schemas (qwen3_coder).
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "ratio": {"type": "number"}, "where": {"type": "object"}, "tags": {"type": "array", "items": {"type": "string"}},
        "note": {"type": ["string", "null"]}, "code": {"anyOf": [{"type": "integer"}, {"type": "string"}]}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
        "tz": {"type": "string"}}}}},
]


def weather(city: str) -> ParsedCall:
    return ParsedCall("get_weather", json.dumps({"city": city}))


TIME = ParsedCall("get_time", "{}")
Expected = list[Union[str, ParsedCall]]  # content pieces and calls, in order


def parse(parser: str, chunks: list[str], max_calls: Optional[int] = None) -> Expected:
    stream = ToolCallStream(tool_call_format(parser, TOOLS), NAMES, max_calls)
    events: list = []
    for c in chunks:
        events += stream.feed(c)
    events += stream.finish()
    merged: Expected = []
    open_call = False  # a streamed call (CallStart) whose arguments are still coming
    for e in events:  # the text of consecutive chunks is one piece of content
        if isinstance(e, str) and merged and isinstance(merged[-1], str):
            merged[-1] += e
        elif isinstance(e, CallStart):
            merged.append(ParsedCall(e.name, ""))
            open_call = True
        elif isinstance(e, CallArguments):  # a piece of the arguments of the call started last
            assert open_call and isinstance(merged[-1], ParsedCall), events
            merged[-1] = ParsedCall(merged[-1].name, merged[-1].arguments + e.text)
        else:
            merged.append(e)
            open_call = False
    for e in merged:  # whatever the text, every call's arguments are one JSON object
        if isinstance(e, ParsedCall):
            assert isinstance(json.loads(e.arguments), dict), e
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
    # NaN and the infinities are not JSON (json.dumps would write them into the arguments): content
    ("qwen25", '<tool_call>{"name": "get_weather", "arguments": {"city": NaN}}</tool_call>',
     ['<tool_call>{"name": "get_weather", "arguments": {"city": NaN}}</tool_call>']),
    ("qwen25", '<tool_call>{"name": "get_weather", "arguments": {"city": [1e999]}}</tool_call>',
     ['<tool_call>{"name": "get_weather", "arguments": {"city": [1e999]}}</tool_call>']),
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
    ("mistral", '[TOOL_CALLS]get_time[ARGS]{"a": -Infinity}', ['[TOOL_CALLS]get_time[ARGS]{"a": -Infinity}']),
    ("llama3", '{"name": "get_time", "parameters": {"a": NaN}}', ['{"name": "get_time", "parameters": {"a": NaN}}']),
    ("mistral", '[TOOL_CALLS]get_time[ARGS]{"a": ]}', ['[TOOL_CALLS]get_time[ARGS]{"a": ]}']),
    ("mistral", "[TOOL_CALLS]get_time is a tool", ["[TOOL_CALLS]get_time is a tool"]),
    ("mistral", '[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]rm[ARGS]{}', [TIME, "[TOOL_CALLS]rm[ARGS]{}"]),
    # ---- mistral with [CALL_ID]: [TOOL_CALLS]name[CALL_ID]id[ARGS]{...}
    ("mistral", '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}', [weather("Paris")]),
    ("mistral", 'Ok.[TOOL_CALLS]get_time[CALL_ID]x9[ARGS]{}[TOOL_CALLS]get_weather[CALL_ID] Q7 [ARGS]{"city": "Oslo"}',
     ["Ok.", TIME, weather("Oslo")]),
    ("mistral", "[TOOL_CALLS]get_time[CALL_ID]x y[ARGS]{}", ["[TOOL_CALLS]get_time[CALL_ID]x y[ARGS]{}"]),
    ("mistral", "[TOOL_CALLS]get_time[CALL_ID][ARGS]{}", ["[TOOL_CALLS]get_time[CALL_ID][ARGS]{}"]),
    ("mistral", "[TOOL_CALLS]launch[CALL_ID]abc[ARGS]{}", ["[TOOL_CALLS]launch[CALL_ID]abc[ARGS]{}"]),
    ("mistral", "[TOOL_CALLS]get_time[CALL_ID]abc", ["[TOOL_CALLS]get_time[CALL_ID]abc"]),  # cut off
    ("mistral", "[TOOL_CALLS]get_time[CALL_ID]abc and more", ["[TOOL_CALLS]get_time[CALL_ID]abc and more"]),
    # ---- qwen3_coder (XML, values typed by the tools' schemas; the calls stream)
    ("qwen3_coder", "Let me check.\n" + "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
     "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
     ["Let me check.", ParsedCall("get_weather", '{"city": "Paris", "days": 3}')]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
     "</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>\n", [weather("Paris"), TIME]),
    ("qwen3_coder", "<tool_call><function=get_time></function></tool_call>\n\nIt is noon.", [TIME, "\n\nIt is noon."]),
    # typed by the schema: integer, boolean, number, object, array; a string stays a string
    # (quotes, digits and all); what does not read as its type stays the string written
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=days>\n 7 \n</parameter>\n"
     "<parameter=metric>\nTrue\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n"
     '<parameter=where>\n{"lat": 48.9, "lon": 2.3}\n</parameter>\n<parameter=tags>\n["a", "b"]\n</parameter>\n'
     '<parameter=city>\n007 "x"\n</parameter>\n</function>\n</tool_call>',
     [ParsedCall("get_weather", json.dumps({"days": 7, "metric": True, "ratio": 0.5, "where": {"lat": 48.9, "lon": 2.3},
                                            "tags": ["a", "b"], "city": '007 "x"'}))]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n"
     "<parameter=metric>\nyes\n</parameter>\n<parameter=where>\n{broken\n</parameter>\n"
     "<parameter=tags>\n{}\n</parameter>\n<parameter=ratio>\nNaN\n</parameter>\n</function>\n</tool_call>",
     [ParsedCall("get_weather", json.dumps({"days": "three", "metric": "yes", "where": "{broken", "tags": "{}",
                                            "ratio": "NaN"}))]),
    # several types (null or a string; an integer or a string); a parameter the schema does not
    # list: JSON if it is JSON, else the string
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=note>\nnull\n</parameter>\n"
     "<parameter=code>\n42\n</parameter>\n<parameter=extra>\n[1, 2]\n</parameter>\n"
     "<parameter=extra2>\nplain text\n</parameter>\n</function>\n</tool_call>",
     [ParsedCall("get_weather", json.dumps({"note": None, "code": 42, "extra": [1, 2], "extra2": "plain text"}))]),
    # one newline is stripped at each end, not more; markup and non-ASCII inside a value
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\n\n  Zürich <tool_call> {\n\n"
     "</parameter>\n</function>\n</tool_call>",
     [ParsedCall("get_weather", json.dumps({"city": "\n  Zürich <tool_call> {\n"}, ensure_ascii=False))]),
    # a repeated parameter keeps its first value; several functions in one block
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
     "<parameter=city>\nOslo\n</parameter>\n</function>\n<function=get_time>\n</function>\n</tool_call>",
     [weather("Paris"), TIME]),
    # lenient: a missing </parameter>, a missing </function>
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n2\n"
     "</function>\n</tool_call>", [ParsedCall("get_weather", '{"city": "Paris", "days": 2}')]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",
     [weather("Paris")]),
    # not a call before the name is known: the text stays content, markup and all
    ("qwen3_coder", "Hi\n<tool_call>\n<function=launch>\n</function>\n</tool_call>",
     ["Hi\n<tool_call>\n<function=launch>\n</function>\n</tool_call>"]),
    ("qwen3_coder", '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     ['<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>']),
    ("qwen3_coder", "<tool_call>\n<function=get_wea", ["<tool_call>\n<function=get_wea"]),
    ("qwen3_coder", "<tool_call>\n", ["<tool_call>\n"]),
    ("qwen3_coder", "<tool_call>\n<function=get weather>\n</function>", ["<tool_call>\n<function=get weather>\n</function>"]),
    # cut after the name (max_tokens): the call, with the parameters that closed; a value cut short is dropped
    ("qwen3_coder", "<tool_call>\n<function=get_time>", [TIME]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
     "<parameter=days>\n1", [weather("Paris")]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=ci", [ParsedCall("get_weather", "{}")]),
    # after a call, other text ends the block: it is content
    ("qwen3_coder", "<tool_call>\n<function=get_time>\n</function>\nthen <function=launch>",
     [TIME, "\nthen <function=launch>"]),
    # a call without its <tool_call>: a call when the name is a tool's; the functions after it and a
    # closing </tool_call> are its section's; else the markup stays content
    ("qwen3_coder", "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>", [weather("Paris")]),
    ("qwen3_coder", "Let me check.\n<function=get_time>\n</function>\n</tool_call>\nDone.",
     ["Let me check.", TIME, "\nDone."]),
    ("qwen3_coder", "<function=get_time>\n</function>\n<function=get_weather>\n<parameter=city>\nOslo\n"
     "</parameter>\n</function>", [TIME, weather("Oslo")]),
    ("qwen3_coder", "<function=get_weather>\n<parameter=city>\nParis", [ParsedCall("get_weather", "{}")]),
    ("qwen3_coder", "Use <function=launch> to start, or <function=get_wea", ["Use <function=launch> to start, or "
                                                                           "<function=get_wea"]),
    ("qwen3_coder", "x <function=get weather>\n</function>", ["x <function=get weather>\n</function>"]),
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


@pytest.mark.parametrize("parser", ["qwen25", "llama3", "mistral", "qwen3_coder"])
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


def lines_executed(work) -> int:
    """Python lines run by `work()` (every frame it calls): a count of the work done that does not
    depend on the machine's speed, so a test can tell linear from quadratic without a clock."""
    count = 0

    def local(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return local

    previous = sys.gettrace()
    sys.settrace(lambda frame, event, arg: local)
    try:
        work()
    finally:
        sys.settrace(previous)
    return count


def grows_linearly(feed_chunks) -> bool:
    """Twice the one-character chunks cost about twice the lines (2.0 for linear work; rescanning the
    section from its start on every chunk would cost 4x)."""
    small, large = lines_executed(lambda: feed_chunks(1000)), lines_executed(lambda: feed_chunks(2000))
    return large < 2.5 * small


def test_a_long_call_section_is_scanned_in_linear_time() -> None:
    def feed_chunks(n: int) -> None:
        stream = ToolCallStream(tool_call_format("mistral"), NAMES)
        stream.feed('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "')
        for _ in range(n):
            stream.feed("a")
        assert stream.feed('"}}]') == [weather("a" * n)]

    assert grows_linearly(feed_chunks)


def test_qwen3_coder_streams_a_call_by_parameter() -> None:
    """The name as soon as <function=NAME> closes, then each parameter as it closes."""
    stream = ToolCallStream(tool_call_format("qwen3_coder", TOOLS), NAMES)
    assert stream.feed("On it.\n<tool_call>\n<function=get_wea") == ["On it."]
    assert stream.feed("ther>\n<parameter=city>\nPar") == [CallStart("get_weather")]
    assert stream.feed("is\n</parameter>\n<parameter=days>\n") == [CallArguments('{"city": "Paris"')]
    assert stream.feed("2\n</parameter>\n") == [CallArguments(', "days": 2')]
    assert stream.feed("</function>\n</tool_call>") == [CallArguments("}")]
    assert stream.finish() == []


def test_qwen3_coder_without_schemas_reads_json_else_a_string() -> None:
    stream = ToolCallStream(tool_call_format("qwen3_coder"), NAMES)  # no tools given: no types known
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=far>\n1e999\n</parameter>\n"
            "</function>\n</tool_call>")
    events = stream.feed(text) + stream.finish()
    assert events[0] == CallStart("get_weather")
    args = "".join(e.text for e in events[1:])
    assert args == '{"city": "Paris", "days": 3, "metric": true, "far": "1e999"}'


def test_qwen3_coder_parallel_tool_calls_false_keeps_the_first_call() -> None:
    one = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    two = "<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n</parameter>\n</function>\n</tool_call>"
    text = "Both.\n" + one + "\n" + two + "\nDone."
    for chunks in chunkings(text):
        assert parse("qwen3_coder", chunks, max_calls=1) == ["Both.", weather("Paris"), "\nDone."], chunks


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
    # A call id is held while it may still be one; text that cannot be is content at once.
    stream = ToolCallStream(tool_call_format("mistral"), NAMES)
    assert stream.feed("[TOOL_CALLS]get_time[CALL_ID]a1B2") == []
    assert stream.feed("c3D4e[AR") == []
    assert stream.feed("GS]{}") == [TIME]
    stream = ToolCallStream(tool_call_format("mistral"), NAMES)
    assert stream.feed("[TOOL_CALLS]get_time[CALL_ID]a1 b") == ["[TOOL_CALLS]get_time[CALL_ID]a1 b"]


def test_a_long_qwen3_coder_value_is_scanned_in_linear_time(monkeypatch) -> None:
    import sglang.srt.entrypoints.openai.tool_parsers.qwen3_coder as qwen3_coder

    # The tag search is str.find from where the last one stopped: C code, invisible to the line
    # count, so the characters each search may look at are counted too.
    searched = 0
    find = qwen3_coder._TagFinder.find

    def counting_find(self, text: str):
        nonlocal searched
        searched += len(text) - self.pos
        return find(self, text)

    monkeypatch.setattr(qwen3_coder._TagFinder, "find", counting_find)

    def feed_chunks(n: int) -> None:
        nonlocal searched
        searched = 0
        stream = ToolCallStream(tool_call_format("qwen3_coder", TOOLS), NAMES)
        assert stream.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\n") == [CallStart("get_weather")]
        for _ in range(n):
            assert stream.feed("a") == []
        assert stream.feed("\n</parameter>\n</function>\n</tool_call>") == [
            CallArguments('{"city": "' + "a" * n + '"'), CallArguments("}")]
        # Each character is searched a bounded number of times (a tag's length held back, per tag
        # finder), not once per chunk after it.
        assert searched < 100 * n, (searched, n)

    assert grows_linearly(feed_chunks)


def test_parser_names() -> None:
    assert {"qwen25", "hermes", "llama3", "mistral", "qwen3_coder"} <= set(TOOL_CALL_PARSERS)
    assert tool_call_format("qwen25").start_markers == tool_call_format("hermes").start_markers == ("<tool_call>",)
