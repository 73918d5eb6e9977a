"""tool_choice "required" and named functions end to end: a real server with the xgrammar backend and
no --tool-call-parser (none is needed: the output is constrained to the calls' JSON and read as
it), with --reasoning-parser deepseek-r1 on (whose parser would take a reply without </think> for
reasoning: forced calls bypass it), through the official `openai` client on the echo checkpoint
(echo_checkpoint.py: the model repeats a scripted reply).

Checked: a scripted valid call becomes message.tool_calls with null content and finish_reason
"tool_calls" (for "required"; "stop" for a named function, as OpenAI's API answers), whole and streamed (the stream adds up to the same call; a named call's arguments stream
as they are written); the grammar holds when the model writes something else (the echo model's script is
plain text or a wrong value, and the reply is still one schema-valid call); `strict: true` tools
are taken there, and under "auto" need the parser like any tools (strict under "auto" itself:
test_strict_tools_server.py); a second constraint beside the tool choice is a 400.
"""

from __future__ import annotations

import json

import pytest

from echo_checkpoint import echo_body
from tool_calls_testlib import TOOLS, ask, ask_streamed, same_reply

openai = pytest.importorskip("openai")  # the official client; the GPU machine may lack it

pytest.importorskip("xgrammar")

UNITS = ["celsius", "fahrenheit"]
SET_UNIT = {"type": "function", "function": {"name": "set_unit", "strict": True, "parameters": {
    "type": "object", "properties": {"unit": {"enum": UNITS}}, "required": ["unit"], "additionalProperties": False}}}


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


# The server (conftest.echo_server): the echo checkpoint on the CPU with these flags, started beside
# the other tool-calling modules' servers.
ECHO_SERVER_FLAGS = ("--reasoning-parser", "deepseek-r1", "--grammar-backend", "xgrammar")


@pytest.fixture(scope="module")
def server(echo_server):
    return echo_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


def call_deltas(chunks: list) -> list:
    return [tc for chunk in chunks for choice in chunk.choices for tc in (choice.delta.tool_calls or [])]


def test_a_named_function_call(server, client) -> None:
    args = '{"city": "Paris"}'
    body = echo_body(server, args, tools=TOOLS, tool_choice=named("get_weather"))
    choice = ask(client, body).choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's for a named tool_choice; "tool_calls" for "required"
    assert choice.message.content is None and getattr(choice.message, "reasoning_content", None) is None
    [tc] = choice.message.tool_calls
    assert tc.type == "function" and tc.id.startswith("call_") and len(tc.id) == 29
    assert tc.function.name == "get_weather" and tc.function.arguments == args  # the output itself
    streamed, chunks = ask_streamed(client, body)
    same_reply(streamed[0], choice)
    assert streamed[0]["calls"][0]["arguments"] == args
    deltas = call_deltas(chunks)
    # The call's id, type and name first; then its arguments, in as many pieces as the stream gave
    # (that they stream as they are written: the next test).
    assert deltas[0].id and deltas[0].type == "function" and deltas[0].function.name == "get_weather"
    assert all(d.index == 0 and d.id is None for d in deltas[1:]) and len(deltas) > 1
    assert not any(choice.delta.content for chunk in chunks for choice in chunk.choices)


def test_a_named_calls_arguments_stream_as_they_are_written(server, client) -> None:
    """A named call's arguments are sent while the model writes them, not held until the call
    closes. Measured in tokens, not in chunks: news that arrives while the server's reader is away
    is merged into one chunk (as upstream's), so how many chunks a reply gives is timing. With
    continuous usage stats every chunk carries the completion tokens written when it was sent: a
    piece of the arguments must go out before half of them (~180 tokens of a long argument) are
    written, which only a server that holds them back, or a reader stalled for that whole time,
    would miss."""
    args = json.dumps({"city": "Paris " * 90})
    body = echo_body(server, args, tools=TOOLS, tool_choice=named("get_weather"),
                     stream_options={"include_usage": True, "continuous_usage_stats": True})
    streamed, chunks = ask_streamed(client, body)
    assert streamed[0]["calls"][0]["arguments"] == args and streamed[0]["finish"] == "stop"
    total = chunks[-1].usage.completion_tokens
    first = next(c for c in chunks if any(tc.function.arguments for tc in call_deltas([c])))
    assert first.usage.completion_tokens <= total // 2, (first.usage.completion_tokens, total)


def test_required_calls(server, client) -> None:
    calls = [{"name": "get_weather", "parameters": {"city": "Paris"}},
             {"name": "get_time", "parameters": {"tz": "Asia/Tokyo"}}]
    body = echo_body(server, json.dumps(calls), tools=TOOLS, tool_choice="required")
    choice = ask(client, body).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in choice.message.tool_calls] == \
        [(c["name"], c["parameters"]) for c in calls]
    assert len({tc.id for tc in choice.message.tool_calls}) == 2
    streamed, chunks = ask_streamed(client, body)
    same_reply(streamed[0], choice)
    # Each call whole once its item closes: a delta with the id and name, then one with the arguments.
    assert [d.index for d in call_deltas(chunks)] == [0, 0, 1, 1]


def test_the_grammar_holds_a_named_call_to_its_schema(server, client) -> None:
    """The model is scripted to refuse in prose: the constraint makes it write the call anyway."""
    body = echo_body(server, "I refuse to call it.", tools=[SET_UNIT], tool_choice=named("set_unit"), max_tokens=40)
    choice = ask(client, body).choices[0]
    [tc] = choice.message.tool_calls
    assert choice.finish_reason == "stop" and tc.function.name == "set_unit"
    assert json.loads(tc.function.arguments)["unit"] in UNITS and set(json.loads(tc.function.arguments)) == {"unit"}
    streamed, _ = ask_streamed(client, body)
    same_reply(streamed[0], choice)
    # A wrong value mid-way: the valid prefix is the model's, the rest the grammar's.
    body = echo_body(server, '{"unit": "kelvin"}', tools=[SET_UNIT], tool_choice=named("set_unit"), max_tokens=40)
    args = json.loads(ask(client, body).choices[0].message.tool_calls[0].function.arguments)
    assert args["unit"] in UNITS


def test_the_grammar_holds_required_to_the_tools(server, client) -> None:
    """Scripted prose again; past its script the echo model has no preference, and greedy decoding
    takes the grammar's lowest token id (one tool with an enum keeps that path short)."""
    body = echo_body(server, "No tools today, thanks.", tools=[SET_UNIT], tool_choice="required",
                     parallel_tool_calls=False, max_tokens=80)
    choice = ask(client, body).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [tc] = choice.message.tool_calls  # parallel_tool_calls false: exactly one
    assert tc.function.name == "set_unit" and json.loads(tc.function.arguments)["unit"] in UNITS
    streamed, _ = ask_streamed(client, body)
    same_reply(streamed[0], choice)


def test_a_call_cut_by_max_tokens(server, client) -> None:
    body = echo_body(server, '{"city": "Paris"}', tools=TOOLS, tool_choice=named("get_weather"), max_tokens=3)
    choice = ask(client, body).choices[0]
    # The arguments written so far, and finish_reason "length" saying they were cut.
    assert choice.finish_reason == "length" and choice.message.tool_calls[0].function.arguments.startswith("{")
    streamed, _ = ask_streamed(client, body)
    assert streamed[0]["calls"][0]["arguments"] == choice.message.tool_calls[0].function.arguments
    calls = [{"name": "get_time", "parameters": {}}, {"name": "get_time", "parameters": {}}]
    body = echo_body(server, json.dumps(calls), tools=TOOLS, tool_choice="required")
    body["max_tokens"] -= 12  # into the second item: the first is a call, the open one is dropped
    choice = ask(client, body).choices[0]
    assert choice.finish_reason == "length" and [tc.function.name for tc in choice.message.tool_calls] == ["get_time"]


@pytest.mark.parametrize("extra, param, fragment", [
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     'response_format cannot be combined with tool_choice "required"'),
    ({"tool_choice": named("get_time"), "regex": "[a-z]+"}, "regex",
     "regex cannot be combined with tool_choice naming the function 'get_time'"),
    ({"tool_choice": "auto"}, "tools", "start the server with --tool-call-parser"),
    ({"tools": [SET_UNIT], "tool_choice": "auto"}, "tools", "start the server with --tool-call-parser"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
      "tool_choice": named("f")}, "tools[0].function.parameters", "must describe an object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "foo"}}}}}], "tool_choice": "required"}, "tools", "Invalid JSON schema in 'tools'"),
])
def test_refused(client, extra: dict, param: str, fragment: str) -> None:
    body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "max_tokens": 4, **extra}
    sglang_fields = {k: body.pop(k) for k in ("regex",) if k in body}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**body, extra_body=sglang_fields)
    assert e.value.body["param"] == param and fragment in e.value.body["message"], e.value.body
