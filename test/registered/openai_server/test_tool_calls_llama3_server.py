"""Llama 3.1 JSON tool calls end to end (`--tool-call-parser llama3`) on the echo checkpoint (see
test_tool_calls_server.py): `<|python_tag|>` (a special token, kept in the text of requests with
tools) or a bare JSON reply, several calls separated by `;`; a JSON answer that is not a call stays
content. A `strict` tool under "auto" is a 400 with this parser: its calls have no marker for a
structural tag to switch on at."""

from __future__ import annotations

import json

import pytest

from echo_checkpoint import echo_body
from tool_calls_testlib import TOOLS, ask, ask_streamed, same_reply

openai = pytest.importorskip("openai")  # the official client; the GPU machine may lack it


# The server (conftest.echo_server): the echo checkpoint on the CPU with these flags, started beside
# the other tool-calling modules' servers.
ECHO_SERVER_FLAGS = ("--tool-call-parser", "llama3")


@pytest.fixture(scope="module")
def server(echo_server):
    return echo_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none")


@pytest.mark.parametrize("text,calls", [
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', [("get_weather", {"city": "Paris"})]),
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {"tz": "UTC"}}',
     [("get_weather", {"city": "Oslo"}), ("get_time", {"tz": "UTC"})]),
    ('{"answer": 42}', []),
])
def test_llama3_calls(server, client, text: str, calls: list) -> None:
    body = echo_body(server, text, tools=TOOLS)
    choice = ask(client, body).choices[0]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []] == calls
    assert choice.message.content == (None if calls else text)
    assert choice.finish_reason == ("tool_calls" if calls else "stop")
    streamed, _ = ask_streamed(client, body)
    same_reply(streamed[0], choice)


def test_strict_under_auto_is_refused_saying_why(client) -> None:
    strict = {"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}],
                                       tools=[TOOLS[1], strict], max_tokens=4)
    assert e.value.body["param"] == "tools[1].function.strict"
    assert "--tool-call-parser llama3" in e.value.body["message"] and "no marker" in e.value.body["message"]
