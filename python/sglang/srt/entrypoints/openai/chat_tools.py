"""The request side of tool calling and reasoning on /v1/chat/completions: checking `tools`,
`tool_choice` and the tool fields of messages, what the chat template gets, and what the reply's
text is parsed for (an OutputSpec).

Decisions (README, "Tool calling and reasoning"):
* `tools` with `tool_choice` "auto" (the default with tools) need `--tool-call-parser`; without
  it they are refused (400) rather than rendered and left unparsed.
* `tool_choice` "none": the tools are not given to the template and nothing is parsed (SGLang's
  behaviour; vLLM renders them unless --exclude-tools-when-tool-choice-none). No parser needed.
* `tool_choice` "required" or a named function, and `strict: true` tools, promise a call (or
  schema-true arguments) that only constrained decoding can keep: refused with a 400 naming the
  alternative, as this server refuses every option it would have to ignore.
* Tool definitions are checked: type "function", a non-empty unique name, an object of parameters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from sglang.srt.entrypoints.openai.chat_output import OutputSpec
from sglang.srt.entrypoints.openai.reasoning_parser import REASONING_PARSERS
from sglang.srt.entrypoints.openai.tool_parsers import tool_call_format
from sglang.srt.managers.generate_request import InvalidRequestError

TOOL_CHOICE_FORMS = '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}'


@dataclass(frozen=True)
class ToolPlan:
    parse: bool  # whether the reply is parsed for tool calls (the template then gets the tools)
    names: frozenset[str]


def _fail(message: str, param: str) -> None:
    raise InvalidRequestError(message, param=param)


def validate_tools(tools: Optional[list[Any]]) -> list[dict[str, Any]]:
    """The request's tool definitions, checked (a 400 names the first bad one)."""
    seen: set[str] = set()
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            _fail(f"{where} must be an object", where)
        if tool.get("type") != "function":
            _fail(f"{where}.type must be \"function\", got {tool.get('type')!r}", f"{where}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            _fail(f"{where}.function must be an object with a name", f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not name.strip():
            _fail(f"{where}.function.name must be a non-empty string", f"{where}.function.name")
        if name in seen:
            _fail(f"{where}.function.name: duplicate tool name {name!r}", f"{where}.function.name")
        seen.add(name)
        if "description" in fn and fn["description"] is not None and not isinstance(fn["description"], str):
            _fail(f"{where}.function.description must be a string", f"{where}.function.description")
        if "parameters" in fn and fn["parameters"] is not None and not isinstance(fn["parameters"], dict):
            _fail(f"{where}.function.parameters must be a JSON Schema object, got {type(fn['parameters']).__name__}",
                  f"{where}.function.parameters")
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            _fail(f"{where}.function.strict must be a boolean", f"{where}.function.strict")
        if strict:
            _fail(f"{where}.function.strict: true needs constrained decoding, which this server does not have; "
                  "drop it (arguments are then what the model wrote, parsed as JSON)", f"{where}.function.strict")
    return list(tools or [])


def _tool_choice(choice: Any, names: frozenset[str]) -> str:
    """"none", "auto", "required" or "named" (the named function is among the tools)."""
    if choice is None:
        return "auto" if names else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            _fail(f"tool_choice must be {TOOL_CHOICE_FORMS}, got {choice!r}", "tool_choice")
        if choice == "required" and not names:
            _fail('tool_choice "required" needs tools', "tool_choice")
        return choice
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        _fail(f"tool_choice must be {TOOL_CHOICE_FORMS}", "tool_choice")
    if name not in names:
        _fail(f"tool_choice names the function {name!r}, which is not among the request's tools "
              f"{sorted(names)}", "tool_choice")
    return "named"


def template_tools(req: Any) -> Optional[list[dict[str, Any]]]:
    """The checked tools a request's chat template gets: its `tools`, unless `tool_choice` is
    "none" (a chat request's; /tokenize's has no tool_choice); None when there are none."""
    tools = validate_tools(getattr(req, "tools", None))
    return tools if tools and getattr(req, "tool_choice", None) != "none" else None


def plan_tools(tools: Optional[list[Any]], tool_choice: Any, tool_call_parser: Optional[str]) -> ToolPlan:
    """What a chat request's tools mean: rendered and parsed, or neither (a 400 for the refused
    combinations; those left render as template_tools() says)."""
    valid = validate_tools(tools)
    names = frozenset(t["function"]["name"] for t in valid)
    choice = _tool_choice(tool_choice, names)
    if choice in ("required", "named"):
        what = 'tool_choice "required"' if choice == "required" else "tool_choice naming a function"
        _fail(f"{what} needs constrained decoding, which this server does not have; use \"auto\" (the model "
              "decides, and the reply's tool_calls carries what it called)", "tool_choice")
    if choice == "none" or not names:
        return ToolPlan(parse=False, names=names)
    if tool_call_parser is None:
        _fail("tools need a tool-call parser: start the server with --tool-call-parser "
              "(qwen25, llama3, mistral, ...), or send tool_choice \"none\"", "tools")
    return ToolPlan(parse=True, names=names)


def message_tool_fields(i: int, msg: Any) -> dict[str, Any]:
    """The tool fields of messages[i] as chat templates read them: an assistant's `tool_calls`
    with each call's `arguments` decoded to an object (HF templates, Qwen's and Llama's among
    them, write `arguments | tojson`), a tool result's `tool_call_id`, and a past turn's
    `reasoning_content`."""
    out: dict[str, Any] = {}
    where = f"messages[{i}]"
    if msg.tool_calls is not None:
        if msg.role != "assistant":
            _fail(f"{where}.tool_calls is only allowed on assistant messages", f"{where}.tool_calls")
        calls = []
        for j, call in enumerate(msg.tool_calls):
            at = f"{where}.tool_calls[{j}]"
            if not isinstance(call, dict):
                _fail(f"{at} must be an object", at)
            if not isinstance(call.get("id"), str) or not call["id"]:
                _fail(f"{at}.id must be a non-empty string", f"{at}.id")
            if call.get("type", "function") != "function":
                _fail(f"{at}.type must be \"function\"", f"{at}.type")
            fn = call.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                _fail(f"{at}.function must be an object with a non-empty name", f"{at}.function")
            args = fn.get("arguments", "{}")
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError:
                    args = None
            if not isinstance(args, dict):
                _fail(f"{at}.function.arguments must be a JSON object encoded as a string", f"{at}.function.arguments")
            calls.append({"id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": args}})
        out["tool_calls"] = calls
    if msg.role == "tool":
        if not isinstance(msg.tool_call_id, str) or not msg.tool_call_id:
            _fail(f"{where}.tool_call_id is required for role 'tool' (the id of the call it answers)",
                  f"{where}.tool_call_id")
        out["tool_call_id"] = msg.tool_call_id
    if msg.role == "assistant" and msg.reasoning_content is not None:
        out["reasoning_content"] = msg.reasoning_content
    return out


def output_spec(req: Any, tool_call_parser: Optional[str], reasoning_parser: Optional[str]) -> OutputSpec:
    """What a chat request's reply text is parsed for (its tools and tool_choice checked: a 400
    for what is malformed or refused)."""
    plan = plan_tools(req.tools, req.tool_choice, tool_call_parser)
    reasoning = REASONING_PARSERS[reasoning_parser] if reasoning_parser else None
    kwargs = req.chat_template_kwargs or {}
    if reasoning is not None and reasoning.honours_enable_thinking and kwargs.get("enable_thinking", True) is False:
        reasoning = None
    return OutputSpec(
        reasoning=reasoning,
        separate_reasoning=req.separate_reasoning,
        stream_reasoning=req.stream_reasoning,
        tool_format=tool_call_format(tool_call_parser) if plan.parse and tool_call_parser else None,
        tool_names=plan.names,
        parallel_tool_calls=req.parallel_tool_calls is not False,
    )


def special_tokens(tokenizer: Any) -> frozenset[str]:
    """The text of every special token of `tokenizer` (None: no tokenizer, no special tokens)."""
    special = set(getattr(tokenizer, "all_special_tokens", ()) or ())
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    special |= {t.content for t in decoder.values() if getattr(t, "special", False)}
    return frozenset(special)


def needs_special_tokens(spec: OutputSpec, special: frozenset[str]) -> bool:
    """Whether a marker the reply is parsed for is one of the `special` tokens (Mistral's
    `[TOOL_CALLS]`, Llama's `<|python_tag|>`): skipping special tokens would erase it from the text."""
    markers: list[str] = list(spec.tool_format.start_markers) if spec.tool_format is not None else []
    if spec.reasoning is not None:
        markers += [spec.reasoning.start, spec.reasoning.end]
    return any(m in special for m in markers)
