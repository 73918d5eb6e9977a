"""`strict: true` tools under tool_choice "auto" end to end: a real server (`--tool-call-parser qwen25
--reasoning-parser qwen3`, the xgrammar backend) through the official `openai` client, on the echo
checkpoint (echo_checkpoint.py: the model repeats a scripted reply; where the grammar masks the
scripted token, greedy decoding takes the grammar's lowest allowed token instead).

Checked: the model is scripted to write prose, then a call with an argument its tool's schema does
not have: under strict the reply is the prose and a schema-valid call (finish_reason "tool_calls",
whole and streamed alike), and without strict the same script keeps the model's invalid call; text
without a call, and a call to a tool without strict in the same request, are what the model wrote;
a call written inside the <think> block is reasoning and is left alone; one constraint per request,
and a strict schema xgrammar refuses is a 400 naming it.
"""

from __future__ import annotations

import json

import pytest
import requests

from echo_checkpoint import echo_body
from tool_calls_testlib import STRICT_FORECAST, TIME, ask, ask_streamed, same_reply, valid_forecast

openai = pytest.importorskip("openai")  # the official client; the GPU machine may lack it

pytest.importorskip("xgrammar")

PROSE = "Let me check."
LOOSE_FORECAST = {"type": "function", "function": {k: v for k, v in STRICT_FORECAST["function"].items()
                                                   if k != "strict"}}


def call(name: str, args: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


# An argument the schema does not list (additionalProperties false): invalid under strict.
EXTRA = PROSE + " " + call("forecast", {"city": "Paris", "hours": 3})


# The server (conftest.echo_server): shared with test_tool_calls_server, whose flags these are; with
# xgrammar installed (or this module is skipped) its grammar backend is xgrammar by default.
ECHO_SERVER_FLAGS = ("--tool-call-parser", "qwen25", "--reasoning-parser", "qwen3")


@pytest.fixture(scope="module")
def server(echo_server):
    info = requests.get(f"{echo_server}/get_server_info", timeout=60).json()
    assert info["grammar_backend"] == "xgrammar", info["grammar_backend"]
    return echo_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


def calls_of(choice) -> list:
    return [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]


def test_strict_keeps_the_call_to_its_schema_and_the_prose_free(server, client) -> None:
    body = echo_body(server, EXTRA, tools=[STRICT_FORECAST, TIME])
    choice = ask(client, body).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == PROSE
    [tc] = choice.message.tool_calls
    assert tc.function.name == "forecast" and valid_forecast(tc.function.arguments), tc.function.arguments
    assert json.loads(tc.function.arguments)["city"] == "Paris"  # the model's own, where valid
    streamed, chunks = ask_streamed(client, body)
    same_reply(streamed[0], choice)
    assert not any("<tool_call>" in (c.delta.content or "") for chunk in chunks for c in chunk.choices)


def test_without_strict_the_models_invalid_call_is_kept(server, client) -> None:
    choice = ask(client, echo_body(server, EXTRA, tools=[LOOSE_FORECAST, TIME])).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == PROSE
    assert calls_of(choice) == [("forecast", {"city": "Paris", "hours": 3})]


@pytest.mark.parametrize("text, content, calls", [
    ("No call needed: it is sunny in Paris.", "No call needed: it is sunny in Paris.", []),
    # A tool without strict in the same request: its arguments are any object, as written.
    (PROSE + " " + call("get_time", {"zone": "UTC", "fmt": 24}), PROSE, [("get_time", {"zone": "UTC", "fmt": 24})]),
])
def test_what_the_constraint_leaves_alone(server, client, text: str, content: str, calls: list) -> None:
    body = echo_body(server, text, tools=[STRICT_FORECAST, TIME])
    choice = ask(client, body).choices[0]
    assert choice.message.content == content and calls_of(choice) == calls
    assert choice.finish_reason == ("tool_calls" if calls else "stop")
    streamed, _ = ask_streamed(client, body)
    same_reply(streamed[0], choice)


def test_a_call_while_thinking_is_reasoning_and_left_alone(server, client) -> None:
    thought = "Maybe " + call("forecast", {"city": "Paris", "hours": 3})
    body = echo_body(server, f"<think>\n{thought}\n</think>\n\n{EXTRA}", tools=[STRICT_FORECAST])
    choice = ask(client, body).choices[0]
    assert choice.message.reasoning_content == thought  # as the model wrote it
    assert choice.finish_reason == "tool_calls" and choice.message.content == PROSE
    [tc] = choice.message.tool_calls
    assert tc.function.name == "forecast" and valid_forecast(tc.function.arguments), tc.function.arguments
    streamed, _ = ask_streamed(client, body)
    same_reply(streamed[0], choice)


@pytest.mark.parametrize("tools, extra, param, fragment", [
    ([STRICT_FORECAST], {"response_format": {"type": "json_object"}}, "response_format",
     'response_format cannot be combined with tool_choice "auto" with strict tools'),
    ([LOOSE_FORECAST, {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"x": {"type": "foo"}}}}}], {}, "tools[1].function.parameters",
     "Invalid JSON schema in 'tools[1].function.parameters'"),
    ([{"type": "function", "function": {"name": "f", "strict": True, "parameters": {"type": "string"}}}], {},
     "tools[0].function.parameters", "must describe an object"),
    # The grammar would write a call to this name that the parser reads back as content.
    ([STRICT_FORECAST, {"type": "function", "function": {"name": "a</tool_call>b"}}], {}, "tools[1].function.name",
     "cannot read back a call to this name"),
])
def test_refused(client, tools: list, extra: dict, param: str, fragment: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}], tools=tools,
                                       max_tokens=4, **extra)
    assert e.value.body["param"] == param and fragment in e.value.body["message"], e.value.body
