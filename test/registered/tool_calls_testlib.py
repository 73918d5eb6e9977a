"""Shared by the tool-calling server tests: tools, and replies through the official `openai`
client, streamed ones put together as a client does."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the tests that use these skip where the client is missing
    import openai

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now, in a time zone.",
                                         "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}}
TOOLS = [WEATHER, TIME]
# A strict tool (the strict-under-"auto" tests): its calls are held to this schema, no other argument.
STRICT_FORECAST = {"type": "function", "function": {
    "name": "forecast", "description": "The forecast for a city.", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"], "additionalProperties": False}}}


def valid_forecast(arguments: str) -> bool:
    """Whether a call's `arguments` are valid against STRICT_FORECAST's schema."""
    args = json.loads(arguments)
    return (isinstance(args, dict) and set(args) <= {"city", "days"} and isinstance(args.get("city"), str)
            and (type(args.get("days", 0)) is int))


EXTENSIONS = ("separate_reasoning", "stream_reasoning", "chat_template_kwargs")  # SGLang's and vLLM's fields


def _client_args(body: dict[str, Any]) -> dict[str, Any]:
    args = {k: v for k, v in body.items() if k not in EXTENSIONS}
    args["extra_body"] = {k: body[k] for k in EXTENSIONS if k in body}
    return args


def ask(client: openai.OpenAI, body: dict[str, Any]) -> Any:
    return client.chat.completions.create(**_client_args(body))


def ask_streamed(client: openai.OpenAI, body: dict[str, Any]) -> tuple[dict[int, dict[str, Any]], list[Any]]:
    """The streamed reply of each choice, put together as a client does, and the chunks."""
    chunks = list(client.chat.completions.create(**_client_args(body), stream=True))
    replies: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            r = replies.setdefault(choice.index, {"content": "", "reasoning": "", "calls": {}, "finish": None})
            delta = choice.delta
            r["content"] += delta.content or ""
            r["reasoning"] += getattr(delta, "reasoning_content", None) or ""
            for tc in delta.tool_calls or []:
                c = r["calls"].setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    assert c["id"] is None, "a call's id comes once"
                    c["id"], c["name"] = tc.id, tc.function.name
                c["arguments"] += tc.function.arguments or ""
            if choice.finish_reason:
                r["finish"] = choice.finish_reason
    return replies, chunks


def as_streamed(choice: Any) -> dict[str, Any]:
    """A non-streamed choice in ask_streamed's shape (ids dropped: each reply draws its own)."""
    m = choice.message
    return {"content": m.content or "", "reasoning": getattr(m, "reasoning_content", None) or "",
            "calls": {i: (c.function.name, json.loads(c.function.arguments)) for i, c in enumerate(m.tool_calls or [])},
            "finish": choice.finish_reason}


def same_reply(streamed: dict[str, Any], choice: Any) -> None:
    got = dict(streamed, calls={i: (c["name"], json.loads(c["arguments"])) for i, c in streamed["calls"].items()})
    assert got == as_streamed(choice)
    ids = [c["id"] for c in streamed["calls"].values()]
    assert all(ids) and len(set(ids)) == len(ids)


def assert_first_call_only(client: openai.OpenAI, body: dict[str, Any], name: str) -> None:
    """With `parallel_tool_calls: false` in `body` (whose script writes two calls), the reply holds
    only the first call, named `name`, whole and streamed alike."""
    whole = ask(client, body).choices[0]
    assert [c.function.name for c in whole.message.tool_calls] == [name]
    streamed, _ = ask_streamed(client, body)
    same_reply(streamed[0], whole)
