"""Tool calling and reasoning end to end with `--tool-call-parser mistral --reasoning-parser
deepseek-r1`, on the echo checkpoint (see test_tool_calls_server.py). Mistral's `[TOOL_CALLS]` is a
special token of the tokenizer: the server keeps special tokens in the text of requests it parses
for calls, and skips them as usual in the others. DeepSeek-R1's template opens the reasoning in the
prompt (the test template's `open_think`), so the reply starts inside it without a tag. A `strict`
tool under "auto" is held to its schema after the reasoning, in either of Mistral's syntaxes.
"""

from __future__ import annotations

import json

import pytest

from echo_checkpoint import echo_body
from tool_calls_testlib import STRICT_FORECAST, TOOLS, ask, ask_streamed, same_reply, valid_forecast

openai = pytest.importorskip("openai")  # the official client; the GPU machine may lack it

CALLS = ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
         '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]')
R1 = {"chat_template_kwargs": {"open_think": True}}


# The server (conftest.echo_server): the echo checkpoint on the CPU with these flags, started beside
# the other tool-calling modules' servers.
ECHO_SERVER_FLAGS = ("--tool-call-parser", "mistral", "--reasoning-parser", "deepseek-r1")


@pytest.fixture(scope="module")
def server(echo_server):
    return echo_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none")


def test_reasoning_then_mistral_calls(server, client) -> None:
    body = echo_body(server, "The user wants weather and time.\n</think>\n\n" + CALLS, tools=TOOLS, **R1)
    choice = ask(client, body).choices[0]
    assert choice.message.reasoning_content == "The user wants weather and time."
    assert choice.message.content is None and choice.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris"})]
    # Mistral's templates take back only ids of 9 letters and digits.
    assert all(len(c.id) == 9 and c.id.isalnum() for c in choice.message.tool_calls)
    streamed, _ = ask_streamed(client, body)
    same_reply(streamed[0], choice)


def test_mistral_v11_calls(server, client) -> None:
    """Tokenizer v11+'s syntax, a marker per call: `[TOOL_CALLS]name[ARGS]{...}` (`[ARGS]` is
    plain text in the echo tokenizer; in Mistral's it is special, kept with the marker's tokens)."""
    calls = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}'
    body = echo_body(server, "Two calls.\n</think>\n\nOn it.\n" + calls, tools=TOOLS, **R1)
    choice = ask(client, body).choices[0]
    assert choice.message.reasoning_content == "Two calls." and choice.message.content == "On it."
    assert choice.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})]
    assert all(len(c.id) == 9 and c.id.isalnum() for c in choice.message.tool_calls)
    streamed, _ = ask_streamed(client, body)
    same_reply(streamed[0], choice)
    # A name outside the tools is not a call: the text stays content, marker and all.
    body = echo_body(server, "No.\n</think>\n\n[TOOL_CALLS]launch[ARGS]{}", tools=TOOLS, **R1)
    choice = ask(client, body).choices[0]
    assert choice.message.content == "[TOOL_CALLS]launch[ARGS]{}" and not choice.message.tool_calls
    streamed, _ = ask_streamed(client, body)
    same_reply(streamed[0], choice)


def test_without_tools_the_special_marker_is_skipped_as_usual(server, client) -> None:
    choice = ask(client, echo_body(server, "Done.\n</think>\n\n" + CALLS, **R1)).choices[0]
    assert choice.message.reasoning_content == "Done."
    # The marker is gone from the text (and the space after it with the whitespace after the reasoning).
    assert choice.message.content == CALLS.replace("[TOOL_CALLS] ", "") and choice.finish_reason == "stop"


def test_reasoning_that_never_ends(server, client) -> None:
    body = echo_body(server, "Still thinking about it", tools=TOOLS, **R1)
    choice = ask(client, body).choices[0]
    assert choice.message.reasoning_content == "Still thinking about it" and choice.message.content == ""
    streamed, _ = ask_streamed(client, body)
    same_reply(streamed[0], choice)
    body["stream_reasoning"] = False  # SGLang's: the reasoning in one piece
    streamed, chunks = ask_streamed(client, body)
    same_reply(streamed[0], choice)
    pieces = [c.choices[0].delta.reasoning_content for c in chunks
              if c.choices and getattr(c.choices[0].delta, "reasoning_content", None)]
    assert pieces == ["Still thinking about it"]


@pytest.mark.parametrize("calls", [
    '[TOOL_CALLS] [{"name": "forecast", "arguments": {"city": "Paris", "hours": 3}}]',
    '[TOOL_CALLS]forecast[ARGS]{"city": "Paris", "hours": 3}',
])
def test_a_strict_tools_call_is_held_to_its_schema_after_the_reasoning(server, client, calls: str) -> None:
    thought = 'Maybe forecast with {"hours": 3}.'  # the reasoning is free text
    body = echo_body(server, f"{thought}\n</think>\n\n{calls}", tools=[STRICT_FORECAST], **R1)
    choice = ask(client, body).choices[0]
    assert choice.message.reasoning_content == thought and choice.message.content is None
    assert choice.finish_reason == "tool_calls"
    [tc] = choice.message.tool_calls
    assert tc.function.name == "forecast" and valid_forecast(tc.function.arguments), tc.function.arguments
    streamed, _ = ask_streamed(client, body)
    same_reply(streamed[0], choice)
