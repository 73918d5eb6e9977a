"""Tool calling and reasoning end to end with `--tool-call-parser mistral --reasoning-parser
deepseek-r1`, on the echo checkpoint (see test_tool_calls_server.py). Mistral's `[TOOL_CALLS]` is a
special token of the tokenizer: the server keeps special tokens in the text of requests it parses
for calls, and skips them as usual in the others. DeepSeek-R1's template opens the reasoning in the
prompt (the test template's `open_think`), so the reply starts inside it without a tag. A `strict`
tool under "auto" is held to its schema after the reasoning, in either of Mistral's syntaxes. A reply
held to a JSON schema, regex or grammar from its first token is the content, not reasoning.
"""

from __future__ import annotations

import json

import pytest
import requests

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


# Constraints that hold the output from its first token: it is the answer, with no room for a reasoning
# block, so it is the content (DeepSeek-R1's parser would read a reply without </think> as reasoning).
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
FROM_THE_FIRST_TOKEN = {
    "json_object": ({"response_format": {"type": "json_object"}}, '{"city": "Paris"}'),
    "json_schema": ({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": CITY}}},
                    '{"city": "Paris"}'),
    "guided_json": ({"guided_json": CITY}, '{"city": "Paris"}'),
    "regex": ({"regex": "(yes|no), [a-z]+"}, "yes, sir"),
    "guided_choice": ({"guided_choice": ["yes", "no"]}, "no"),
    "ebnf": ({"ebnf": 'root ::= "A" [0-9]+'}, "A42"),
}


def ask_raw(server: str, body: dict, stream: bool = False) -> dict:
    """The first choice of a reply over plain HTTP (vLLM's and SGLang's extra fields at the top
    level); streamed, its deltas put together: {"content", "reasoning_content", "finish_reason"}."""
    r = requests.post(f"{server}/v1/chat/completions", json={**body, "stream": stream}, timeout=120, stream=stream)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["choices"][0]
    out = {"content": "", "reasoning_content": "", "finish_reason": None}
    for line in r.iter_lines():
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        for choice in json.loads(line[6:])["choices"]:
            out["content"] += choice["delta"].get("content") or ""
            out["reasoning_content"] += choice["delta"].get("reasoning_content") or ""
            out["finish_reason"] = choice["finish_reason"] or out["finish_reason"]
    return out


@pytest.mark.parametrize("name", list(FROM_THE_FIRST_TOKEN))
def test_an_output_constrained_from_its_first_token_is_the_content(server, name: str) -> None:
    fields, text = FROM_THE_FIRST_TOKEN[name]
    body = echo_body(server, text, **R1, **fields)
    choice = ask_raw(server, body)
    assert choice["finish_reason"] == "stop"
    assert (choice["message"]["content"], choice["message"]["reasoning_content"]) == (text, None)
    assert ask_raw(server, body, stream=True) == {"content": text, "reasoning_content": "", "finish_reason": "stop"}


def test_a_structural_tag_leaves_the_reasoning_free(server) -> None:
    """A structural tag's text is free until a trigger: the model may reason first, and the reply is
    split as without it."""
    tag = {"type": "structural_tag", "triggers": ["<function="],
           "structures": [{"begin": "<function=get_weather>", "schema": CITY, "end": "</function>"}]}
    body = echo_body(server, "Easy.\n</think>\n\nParis.", response_format=tag, **R1)
    choice = ask_raw(server, body)
    assert (choice["message"]["reasoning_content"], choice["message"]["content"]) == ("Easy.", "Paris.")
    assert ask_raw(server, body, stream=True) == {"content": "Paris.", "reasoning_content": "Easy.",
                                                  "finish_reason": "stop"}
