"""Tool calling and reasoning end to end: a real server (`--tool-call-parser qwen25 --reasoning-parser
qwen3`) and the official `openai` client, on the echo checkpoint (echo_checkpoint.py): a real
one-layer model whose hand-set weights make it repeat the end of the prompt, so each test scripts
the reply, markup and all, and the server tokenises, generates, detokenises and streams it.

Checked: the chat template renders tools, assistant tool calls and tool results as transformers'
own apply_chat_template does; replies become message.tool_calls / reasoning_content / content with
finish_reason "tool_calls"; a stream adds up to the non-streamed reply, text before a call streams
before it, and no call markup reaches delta.content; tool_choice "none", parallel_tool_calls,
separate_reasoning and enable_thinking; the server info names the parsers.
"""

from __future__ import annotations

import json

import pytest
import requests

from echo_checkpoint import echo_body, echo_checkpoint
from tool_calls_testlib import assert_first_call_only, TOOLS, ask, ask_streamed, same_reply

openai = pytest.importorskip("openai")  # the official client; the GPU machine may lack it


def call(name: str, args: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


PARIS = call("get_weather", {"city": "Paris"})
TOKYO_TIME = call("get_time", {"tz": "Asia/Tokyo"})


# The server (conftest.echo_server): the echo checkpoint on the CPU with these flags, started beside
# the other tool-calling modules' servers.
ECHO_SERVER_FLAGS = ("--tool-call-parser", "qwen25", "--reasoning-parser", "qwen3")


@pytest.fixture(scope="module")
def server(echo_server):
    return echo_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none")


# ---------------------------------------------------------------------------- the prompt
def test_template_renders_tool_turns_as_transformers_does(server) -> None:
    from transformers import AutoTokenizer

    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
             {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "Europe/Paris"}'}}]
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather and time in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18}'},
        {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
        {"role": "user", "content": "Thanks. Anything else?"},
    ]
    served = requests.post(f"{server}/tokenize", json={"messages": messages, "tools": TOOLS}, timeout=60).json()["tokens"]
    # transformers' own rendering, with its conventions: arguments as objects.
    hf_messages = [dict(m) for m in messages]
    hf_messages[2] = {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
        for c in calls]}
    tok = AutoTokenizer.from_pretrained(echo_checkpoint())
    expected = tok.apply_chat_template(hf_messages, tools=TOOLS, tokenize=True, add_generation_prompt=True,
                                       return_dict=False)
    assert served == list(expected)
    text = tok.decode(served)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n14:05\n</tool_response>" in text


def test_tool_choice_none_does_not_render_the_tools(server, client) -> None:
    messages = [{"role": "user", "content": "hi"}]
    plain = requests.post(f"{server}/tokenize", json={"messages": messages}, timeout=60).json()["count"]
    with_tools = requests.post(f"{server}/tokenize", json={"messages": messages, "tools": TOOLS}, timeout=60).json()["count"]
    assert with_tools > plain + 50
    r = ask(client, {"model": "default", "messages": messages, "tools": TOOLS, "tool_choice": "none", "max_tokens": 1})
    assert r.usage.prompt_tokens == plain
    r = ask(client, {"model": "default", "messages": messages, "tools": TOOLS, "max_tokens": 1})
    assert r.usage.prompt_tokens == with_tools


# ---------------------------------------------------------------------------- replies
def test_a_tool_call_reply(server, client) -> None:
    r = ask(client, echo_body(server, "Let me check.\n" + PARIS, tools=TOOLS))
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    assert choice.message.reasoning_content is None
    [tc] = choice.message.tool_calls
    assert tc.type == "function" and tc.id.startswith("call_") and len(tc.id) == 29
    assert tc.function.name == "get_weather" and json.loads(tc.function.arguments) == {"city": "Paris"}


SCRIPTS = {
    "reasoning, text and two calls": "<think>\nThe user wants two things.\n</think>\n\nChecking both.\n" + PARIS + "\n" + TOKYO_TIME,
    "only calls": PARIS + "\n" + TOKYO_TIME,
    "plain text": "It is sunny in Paris, 18 degrees.",
    "reasoning and text": "<think>\nEasy.\n</think>\n\nFour.",
    "an unknown function stays content": 'Trying.\n<tool_call>\n{"name": "launch_rocket", "arguments": {}}\n</tool_call>',
    "broken JSON stays content": '<tool_call>\n{"name": "get_time", "arguments": {"tz": }\n</tool_call>',
}


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_streamed_reply_adds_up_to_the_reply(server, client, script: str) -> None:
    body = echo_body(server, SCRIPTS[script], tools=TOOLS)
    whole = ask(client, body).choices[0]
    streamed, chunks = ask_streamed(client, body)
    same_reply(streamed[0], whole)
    calls = bool(whole.message.tool_calls)
    assert whole.finish_reason == ("tool_calls" if calls else "stop")
    if calls:  # the markup of a parsed call never reaches the content, streamed or not
        for chunk in chunks:
            for choice in chunk.choices:
                assert "<tool_call>" not in (choice.delta.content or "") and "</tool" not in (choice.delta.content or "")
    else:  # a reply without calls keeps every character outside the reasoning
        assert whole.message.content == SCRIPTS[script].split("</think>\n\n")[-1]


def test_text_before_a_call_streams_before_it(server, client) -> None:
    """The text is sent as it is written, not held until the call is read. Measured in tokens, not
    in chunks: news that arrives while the server's reader is away is merged into one chunk (as
    upstream's), so how many chunks a reply gives is timing. With continuous usage stats every
    chunk carries the completion tokens written when it was sent: text must go out before half of
    the long text (~150 tokens) is written, which only a server that holds it back, or a reader
    stalled for that whole time, would miss."""
    text = " ".join(["Let me check that for you."] * 16)
    body = echo_body(server, text + "\n" + PARIS, tools=TOOLS,
                     stream_options={"include_usage": True, "continuous_usage_stats": True})
    streamed, chunks = ask_streamed(client, body)
    assert streamed[0]["content"] == text and [c["name"] for c in streamed[0]["calls"].values()] == ["get_weather"]
    kinds, sent_at = [], {}
    for chunk in chunks:
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None and delta.content:
            kinds.append("content")
            sent_at.setdefault("content", chunk.usage.completion_tokens)
        if delta is not None and delta.tool_calls:
            kinds.append("call")
            sent_at.setdefault("call", chunk.usage.completion_tokens)
    # All of the text before the call (its id and name, then its arguments) ...
    assert kinds[-2:] == ["call", "call"] and "call" not in kinds[:-2] and "content" in kinds
    # ... and the first of it while the model was still writing the text.
    assert sent_at["content"] <= sent_at["call"] // 2, sent_at


def test_choices_of_n_parse_apart(server, client) -> None:
    body = echo_body(server, "Both.\n" + PARIS + "\n" + TOKYO_TIME, tools=TOOLS, n=2)
    whole = ask(client, body)
    streamed, _ = ask_streamed(client, body)
    assert sorted(streamed) == [0, 1]
    for choice in whole.choices:
        same_reply(streamed[choice.index], choice)
        assert [c.function.name for c in choice.message.tool_calls] == ["get_weather", "get_time"]


def test_parallel_tool_calls_false_keeps_the_first_call(server, client) -> None:
    assert_first_call_only(client, echo_body(server, PARIS + "\n" + TOKYO_TIME, tools=TOOLS, parallel_tool_calls=False),
                           "get_weather")


def test_tool_choice_none_leaves_the_markup_in_the_content(server, client) -> None:
    text = "Let me check.\n" + PARIS
    choice = ask(client, echo_body(server, text, tools=TOOLS, tool_choice="none")).choices[0]
    assert choice.message.content == text and not choice.message.tool_calls and choice.finish_reason == "stop"


def test_separate_reasoning_false_and_enable_thinking_false(server, client) -> None:
    text = "<think>\nHmm.\n</think>\n\nYes."
    choice = ask(client, echo_body(server, text, separate_reasoning=False)).choices[0]
    assert choice.message.content == text and choice.message.reasoning_content is None
    # enable_thinking=false: the template closes an empty block in the prompt; the reply is content.
    body = echo_body(server, text, chat_template_kwargs={"enable_thinking": False})
    assert body["messages"] != echo_body(server, text)["messages"]  # another prompt, another padding
    choice = ask(client, body).choices[0]
    assert choice.message.content == text and choice.message.reasoning_content is None
    choice = ask(client, echo_body(server, text)).choices[0]
    assert choice.message.content == "Yes." and choice.message.reasoning_content == "Hmm."


def test_a_conversation_with_tool_results(server, client) -> None:
    """A second turn: the assistant's calls and their results go back through the template; the
    reply (scripted in the last tool result) is content again."""
    first = ask(client, echo_body(server, "Let me check.\n" + PARIS, tools=TOOLS)).choices[0].message
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": first.content,
                "tool_calls": [tc.model_dump() for tc in first.tool_calls]},
               {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": ""}]
    body = echo_body(server, "It is 18 degrees and sunny in Paris.", messages=history, tools=TOOLS)
    choice = ask(client, body).choices[0]
    assert choice.message.content == "It is 18 degrees and sunny in Paris." and choice.finish_reason == "stop"
    assert not choice.message.tool_calls


def test_server_info_names_the_parsers(server) -> None:
    info = requests.get(f"{server}/get_server_info", timeout=60).json()
    assert info["tool_call_parser"] == "qwen25" and info["reasoning_parser"] == "qwen3"
