"""Qwen3-Coder's XML tool calls end to end (`--tool-call-parser qwen3_coder`) on the echo checkpoint
(see test_tool_calls_server.py): raw parameter values typed by the request's tool schemas, several
calls in a row, text before them as content; streamed, a call's name comes before its arguments,
which come a parameter at a time, and the stream adds up to the non-streamed reply. A `strict`
tool under "auto": a wrong-typed parameter the model writes becomes one of the schema's type."""

from __future__ import annotations

import json

import pytest

from echo_checkpoint import echo_body
from tool_calls_testlib import STRICT_FORECAST, TIME, ask, ask_streamed, assert_first_call_only, same_reply, valid_forecast

openai = pytest.importorskip("openai")  # the official client; the GPU machine may lack it

FORECAST = {"type": "function", "function": {
    "name": "get_weather", "description": "The forecast for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                    "metric": {"type": "boolean"}}, "required": ["city"]}}}
TOOLS = [FORECAST, TIME]


def call(name: str, params: dict[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


# Types a schema gives through a `$ref` (pydantic writes one for every enum and nested model), an
# `allOf` around one, or the values of an `enum` / `const` without a `type`.
MAIL = {"type": "function", "function": {"name": "mail", "parameters": {
    "type": "object", "$defs": {"zip": {"type": "string"}, "n": {"type": "integer"}},
    "properties": {"zip": {"$ref": "#/$defs/zip"}, "code": {"enum": ["1", "2"]}, "tag": {"const": "7"},
                   "note": {"allOf": [{"$ref": "#/$defs/zip"}], "description": "free text"},
                   "count": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}},
    "required": ["zip"]}}}
MAIL_TEXT = {"zip": "75001", "code": "2", "tag": "7", "note": "true", "count": "4"}
MAIL_ARGS = {"zip": "75001", "code": "2", "tag": "7", "note": "true", "count": 4}
PARIS = call("get_weather", {"city": "Paris", "days": "3", "metric": "true"})
TOKYO_TIME = call("get_time", {"tz": "Asia/Tokyo"})


# The server (conftest.echo_server): the echo checkpoint on the CPU with these flags, started beside
# the other tool-calling modules' servers.
ECHO_SERVER_FLAGS = ("--tool-call-parser", "qwen3_coder")


@pytest.fixture(scope="module")
def server(echo_server):
    return echo_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none")


@pytest.mark.parametrize("text,content,calls", [
    ("Let me check.\n" + PARIS + "\n" + TOKYO_TIME, "Let me check.",
     [("get_weather", {"city": "Paris", "days": 3, "metric": True}), ("get_time", {"tz": "Asia/Tokyo"})]),
    # "007" is a string by its schema; an unknown function stays content, markup and all
    (call("get_weather", {"city": "007"}), None, [("get_weather", {"city": "007"})]),
    ("Trying.\n" + call("launch_rocket", {}), "Trying.\n" + call("launch_rocket", {}), []),
    # a call written without its <tool_call> block
    ("Sure.\n<function=get_time>\n<parameter=tz>\nUTC\n</parameter>\n</function>", "Sure.",
     [("get_time", {"tz": "UTC"})]),
    (call("mail", MAIL_TEXT), None, [("mail", MAIL_ARGS)]),
])
def test_qwen3_coder_calls(server, client, text: str, content, calls: list) -> None:
    body = echo_body(server, text, tools=TOOLS + [MAIL])
    choice = ask(client, body).choices[0]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []] == calls
    assert choice.message.content == content
    assert choice.finish_reason == ("tool_calls" if calls else "stop")
    streamed, _ = ask_streamed(client, body)
    same_reply(streamed[0], choice)


def test_a_call_streams_its_name_then_a_parameter_at_a_time(server, client) -> None:
    body = echo_body(server, "Checking.\n" + PARIS, tools=TOOLS)
    whole = ask(client, body).choices[0]
    streamed, chunks = ask_streamed(client, body)
    same_reply(streamed[0], whole)
    pieces = [tc.function.arguments for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    # The name's delta (its arguments ""), then one per parameter and the closing brace.
    assert pieces == ["", '{"city": "Paris"', ', "days": 3', ', "metric": true', "}"]
    assert "".join(pieces) == whole.message.tool_calls[0].function.arguments
    for chunk in chunks:  # no markup in the content
        for choice in chunk.choices:
            assert "<" not in (choice.delta.content or "")


def test_parallel_tool_calls_false_keeps_the_first_call(server, client) -> None:
    assert_first_call_only(client, echo_body(server, PARIS + "\n" + TOKYO_TIME, tools=TOOLS, parallel_tool_calls=False),
                           "get_weather")


def test_a_strict_tools_parameters_are_held_to_its_schema(server, client) -> None:
    """The structural tag switches on at <tool_call>; "days" is an integer, and "three" is not."""
    text = "Checking.\n" + call("forecast", {"city": "Paris", "days": "three"})
    body = echo_body(server, text, tools=[STRICT_FORECAST, TIME])
    choice = ask(client, body).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    [tc] = choice.message.tool_calls
    assert tc.function.name == "forecast" and valid_forecast(tc.function.arguments), tc.function.arguments
    assert set(json.loads(tc.function.arguments)) == {"city", "days"}
    streamed, _ = ask_streamed(client, body)
    same_reply(streamed[0], choice)
    loose = {"type": "function", "function": {k: v for k, v in STRICT_FORECAST["function"].items() if k != "strict"}}
    choice = ask(client, echo_body(server, text, tools=[loose, TIME])).choices[0]
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris", "days": "three"}


def test_a_strict_tools_referenced_types_are_kept(server, client) -> None:
    """The grammar holds "zip" to the string its `$ref` names; the parser must not read it back as
    the number 75001 (strict promises arguments valid against the schema)."""
    strict = {"type": "function", "function": {**MAIL["function"], "strict": True}}
    choice = ask(client, echo_body(server, call("mail", MAIL_TEXT), tools=[strict])).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == MAIL_ARGS
