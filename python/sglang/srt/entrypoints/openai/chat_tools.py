"""The request side of tool calling and reasoning on /v1/chat/completions: checking `tools`,
`tool_choice` and the tool fields of messages, what the chat template gets, and what the reply's
text is parsed for (an OutputSpec).

Decisions (README, "Tool calling and reasoning"):
* `tools` with `tool_choice` "auto" (the default with tools) need `--tool-call-parser`; without
  it they are refused (400) rather than rendered and left unparsed.
* `tool_choice` "none": the tools are not given to the template and nothing is parsed (SGLang's
  behaviour; vLLM renders them unless --exclude-tools-when-tool-choice-none). No parser needed.
* `tool_choice` "required" or a named function: the output is constrained (the grammar backend,
  --grammar-backend) to the calls' JSON, and read as calls without the model family's parser
  (none is needed): a named function's output is its arguments, a JSON object valid against its
  `parameters`; "required"'s is a JSON array of one or more `{"name": ..., "parameters": {...}}`,
  each item one of the tools (vLLM's and SGLang's shape). `forced_calls_schema` builds the schema.
  The tools are still rendered by the template. Both are one constraint, so response_format, regex
  and the other structured-output fields are refused beside them (structured_outputs.py).
* `strict: true` tools are kept to their schemas under "required" and a named function (the same
  constraint). Under "auto" the model may write text or a call: the output is constrained by a
  structural tag (strict_tools.py), free text until the --tool-call-parser's call marker, then a
  call held to its tool's schema (a tool without strict: any object of arguments), and the reply
  is parsed as without strict. It is the request's one constraint, as a forced choice's is. A
  parser whose calls a structural tag cannot hold (llama3's have no marker) keeps the 400, saying
  why. Under "none" no call is made, so there is nothing to keep.
* Tool definitions are checked: type "function", a non-empty unique name, an object of parameters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from sglang.srt.entrypoints.openai.chat_output import ForcedCalls, OutputSpec
from sglang.srt.entrypoints.openai.reasoning_parser import REASONING_PARSERS, ReasoningFormat
from sglang.srt.entrypoints.openai.strict_tools import ANY_OBJECT, ToolGrammar, strict_tools_tag, unreadable_name
from sglang.srt.entrypoints.openai.structured_outputs import Constraint
from sglang.srt.entrypoints.openai.tool_parsers import TOOL_CALL_PARSERS, tool_call_format
from sglang.srt.managers.generate_request import InvalidRequestError
from sglang.srt.sampling.grammar_spec import GrammarSpec

TOOL_CHOICE_FORMS = '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}'


# JSON Schema keywords whose value is a subschema, a list of them, or a name -> subschema map: where
# `$ref`s are looked for when a tool's schema moves under another root. The other keywords hold
# data (enum, const, default, examples, ...) or plain values, and are kept as they are.
_SUBSCHEMA = ("additionalProperties", "items", "additionalItems", "not", "if", "then", "else", "contains",
              "unevaluatedProperties", "unevaluatedItems", "propertyNames")
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# Keywords that say which members an object may have: an object schema with none of them takes any.
_MEMBER_KEYWORDS = ("properties", "patternProperties", "additionalProperties", "unevaluatedProperties",
                    "anyOf", "oneOf", "allOf", "not", "if", "$ref", "propertyNames", "dependentSchemas")


@dataclass(frozen=True)
class ToolPlan:
    parse: bool  # whether the reply is parsed for tool calls by the --tool-call-parser
    names: frozenset[str]
    forced: Optional[ForcedCalls] = None  # tool_choice "required" or a named function
    # What the output is constrained to: the forced calls, or strict tools' calls under "auto".
    constraint: Optional[Constraint] = None


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


def plan_tools(tools: Optional[list[Any]], tool_choice: Any, tool_call_parser: Optional[str],
               parallel_tool_calls: bool = True, reasoning: Optional[ReasoningFormat] = None) -> ToolPlan:
    """What a chat request's tools mean: parsed from the reply by the --tool-call-parser ("auto",
    its strict tools' calls constrained), forced by a constraint ("required", a named function),
    or neither ("none", no tools); a 400 for the refused combinations. `reasoning`: the reply's
    reasoning format, whose block the strict tools' constraint leaves free. The template renders
    the tools as template_tools() says."""
    valid = validate_tools(tools)
    names = frozenset(t["function"]["name"] for t in valid)
    choice = _tool_choice(tool_choice, names)
    if choice == "named":
        name = tool_choice["function"]["name"]
        i = next(i for i, t in enumerate(valid) if t["function"]["name"] == name)
        schema = _arguments_schema(valid[i]["function"], f"tools[{i}].function.parameters")
        constraint = Constraint(GrammarSpec("json_schema", json.dumps(schema, ensure_ascii=False)),
                                f"tools[{i}].function.parameters", f"tool_choice naming the function {name!r}")
        return ToolPlan(parse=False, names=names, forced=ForcedCalls(function=name), constraint=constraint)
    if choice == "required":
        schema = forced_calls_schema(valid, parallel_tool_calls)
        constraint = Constraint(GrammarSpec("json_schema", json.dumps(schema, ensure_ascii=False)), "tools",
                                'tool_choice "required"')
        return ToolPlan(parse=False, names=names, forced=ForcedCalls(function=None), constraint=constraint)
    if choice == "none" or not names:
        return ToolPlan(parse=False, names=names)
    if tool_call_parser is None:
        _fail("tools need a tool-call parser: start the server with --tool-call-parser "
              "(qwen25, llama3, mistral, ...), or send tool_choice \"none\", \"required\" or a named function "
              "(constrained, no parser needed)", "tools")
    constraint = (_strict_calls_constraint(valid, tool_call_parser, parallel_tool_calls, reasoning)
                  if any(t["function"].get("strict") for t in valid) else None)
    return ToolPlan(parse=True, names=names, constraint=constraint)


def _strict_calls_constraint(tools: list[dict[str, Any]], tool_call_parser: str, parallel_tool_calls: bool,
                             reasoning: Optional[ReasoningFormat]) -> Constraint:
    """tool_choice "auto" with strict tools among the checked `tools`: the structural tag holding
    the calls the parser reads to their tools' schemas."""
    where = f"tools[{next(i for i, t in enumerate(tools) if t['function'].get('strict'))}].function.strict"
    grammars = []
    parts = []
    fmt = TOOL_CALL_PARSERS[tool_call_parser].name
    for i, tool in enumerate(tools):
        fn = tool["function"]
        # Every tool has a tag, so a call to any of them is one the grammar may make the model write.
        why = unreadable_name(fmt, fn["name"])
        if why is not None:
            _fail(f'tools[{i}].function.name {fn["name"]!r}: --tool-call-parser {tool_call_parser} cannot read back '
                  f'a call to this name ({why}), so the strict tools\' constraint under tool_choice "auto" cannot '
                  'hold it. Rename the tool, or drop strict', f"tools[{i}].function.name")
        if not fn.get("strict"):
            grammars.append(ToolGrammar(fn["name"], ANY_OBJECT))
            continue
        field = f"tools[{i}].function.parameters"
        schema = _arguments_schema(fn, field)
        grammars.append(ToolGrammar(fn["name"], schema))
        # Checked alone first, so that a schema xgrammar refuses is named as one, in its own field.
        parts.append((GrammarSpec("json_schema", json.dumps(schema, ensure_ascii=False)), field))
    try:
        tag = strict_tools_tag(fmt, grammars, parallel_tool_calls, reasoning)
    except ValueError as e:
        _fail(f'{where}: true under tool_choice "auto" cannot be kept with --tool-call-parser {tool_call_parser}: '
              f'{e}. Drop strict (the arguments are then what the model wrote, parsed as JSON), or set tool_choice '
              '"required" or a named function (the output is then constrained to the calls\' JSON)', where)
    field = parts[0][1] if len(parts) == 1 else "tools"
    return Constraint(GrammarSpec("structural_tag", json.dumps(tag, ensure_ascii=False)), field,
                      what='tool_choice "auto" with strict tools', holds="its tool calls, to their tools' schemas",
                      asked_by=where, parts=tuple(parts))


# ---------------------------------------------------------------------------- forced calls' schemas
def _arguments_schema(fn: dict[str, Any], where: str) -> dict[str, Any]:
    """The JSON schema of a call's arguments: the function's `parameters`, which must describe an
    object (OpenAI's arguments are one); none or `{}` is any object."""
    params = fn.get("parameters") or {}
    kind = params.get("type", "object")
    if kind != "object":
        _fail(f"{where} must describe an object (the call's arguments are a JSON object), got type {kind!r}",
              where)
    return {**params, "type": "object"}


def _rebased(schema: Any, base: str) -> Any:
    """`schema` with its local `$ref`s ("#", "#/$defs/X", "#/properties/y", ...) pointing below
    `base` (a JSON pointer to where the schema now sits), so that they keep meaning the same."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = base + value[1:]
        elif key in _SUBSCHEMA:
            out[key] = [_rebased(s, base) for s in value] if isinstance(value, list) else _rebased(value, base)
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            out[key] = [_rebased(s, base) for s in value]
        elif key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _rebased(s, base) for name, s in value.items()}
        else:
            out[key] = value
    return out


def forced_calls_schema(tools: list[dict[str, Any]], parallel_tool_calls: bool = True) -> dict[str, Any]:
    """The JSON schema of tool_choice "required"'s output: an array of one or more calls (exactly
    one without parallel_tool_calls), each `{"name": <a tool's name>, "parameters": <its arguments>}`
    (an anyOf over the `tools`, which must be checked ones). Each tool's arguments schema sits in
    the root's `$defs` (as `tool<i>`, its own `$ref`s rebased there): xgrammar resolves JSON
    pointers through objects but not through arrays such as anyOf's."""
    defs: dict[str, Any] = {}
    items = []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        key = f"tool{i}"
        args = _arguments_schema(fn, f"tools[{i}].function.parameters")
        if not any(k in args for k in _MEMBER_KEYWORDS):
            # Any object, said outright: xgrammar (0.2.x) reads a bare {"type": "object"} reached
            # through a $ref as the empty object (its strict mode), though at the root it takes any.
            args["additionalProperties"] = True
        defs[key] = _rebased(args, f"#/$defs/{key}")
        items.append({"type": "object", "properties": {"name": {"enum": [fn["name"]]},
                                                       "parameters": {"$ref": f"#/$defs/{key}"}},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    schema["$defs"] = defs
    return schema


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


def request_reasoning(req: Any, reasoning_parser: Optional[str]) -> Optional[ReasoningFormat]:
    """The reasoning format a chat request's reply is read with (None: none), forced calls aside:
    the --reasoning-parser's, unless the request turns thinking off for a parser that honours it."""
    reasoning = REASONING_PARSERS[reasoning_parser] if reasoning_parser else None
    kwargs = req.chat_template_kwargs or {}
    if reasoning is not None and reasoning.honours_enable_thinking and kwargs.get("enable_thinking", True) is False:
        return None
    return reasoning


def request_plan(req: Any, tool_call_parser: Optional[str], reasoning_parser: Optional[str] = None) -> ToolPlan:
    """plan_tools for a chat request."""
    return plan_tools(req.tools, req.tool_choice, tool_call_parser, req.parallel_tool_calls is not False,
                      request_reasoning(req, reasoning_parser))


def output_spec(req: Any, tool_call_parser: Optional[str], reasoning_parser: Optional[str],
                plan: Optional[ToolPlan] = None, constraint: Optional[Constraint] = None) -> OutputSpec:
    """What a chat request's reply text is parsed for (its tools and tool_choice checked: a 400
    for what is malformed or refused; `plan`: request_plan's, when the caller has it;
    `constraint`: the one the request's output is held to, if any)."""
    plan = plan if plan is not None else request_plan(req, tool_call_parser, reasoning_parser)
    reasoning = request_reasoning(req, reasoning_parser)
    if plan.forced is not None or (constraint is not None and constraint.spec.kind != "structural_tag"):
        # The constraint holds from the first output token (forced calls' JSON, a JSON schema, regex
        # or grammar): the reply is the answer, with no room to think first, and a reasoning parser
        # would only misread it (deepseek-r1's takes a reply without </think> for reasoning). A
        # structural tag's text is free until a trigger: the model may reason first.
        reasoning = None
    return OutputSpec(
        reasoning=reasoning,
        separate_reasoning=req.separate_reasoning,
        stream_reasoning=req.stream_reasoning,
        tool_format=tool_call_format(tool_call_parser, req.tools) if plan.parse and tool_call_parser else None,
        tool_names=plan.names,
        parallel_tool_calls=req.parallel_tool_calls is not False,
        forced=plan.forced,
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
