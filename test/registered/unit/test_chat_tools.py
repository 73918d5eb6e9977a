"""The chat route's tool calling and reasoning without a server: what a request's tools, tool_choice
and messages are checked for and turned into (chat_tools.py), and how a reply splits into
reasoning, content and tool calls when both parsers are on (chat_output.py), whole and streamed;
tool_choice "required" and named functions: the schema the output is constrained to (compiled by
xgrammar on a real tokenizer and matched against valid and invalid outputs) and how the
constrained output becomes tool calls, whole and streamed.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from sglang.srt.entrypoints.openai.chat_output import (
    ForcedCalls,
    OutputSpec,
    TextPart,
    ToolCallArguments,
    ToolCallPart,
    ToolCallStart,
    part_deltas,
)
from sglang.srt.entrypoints.openai.chat_tools import (
    forced_calls_schema,
    message_tool_fields,
    needs_special_tokens,
    output_spec,
    plan_tools,
    special_tokens,
    template_tools,
    validate_tools,
)
from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from sglang.srt.entrypoints.openai.reasoning_parser import REASONING_PARSERS
from sglang.srt.entrypoints.openai.tool_parsers import tool_call_format
from sglang.srt.managers.generate_request import InvalidRequestError

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def error(fn: Any, *args: Any) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as e:
        fn(*args)
    return e.value


# ---------------------------------------------------------------------------- request side
@pytest.mark.parametrize("tools,needle,param", [
    (["get_weather"], "tools[0] must be an object", "tools[0]"),
    ([{"function": {"name": "f"}}], 'tools[0].type must be "function"', "tools[0].type"),
    ([{"type": "function"}], "tools[0].function must be an object", "tools[0].function"),
    ([{"type": "function", "function": {"description": "no name"}}], "name must be a non-empty string",
     "tools[0].function.name"),
    ([{"type": "function", "function": {"name": " "}}], "name must be a non-empty string", "tools[0].function.name"),
    ([WEATHER, {"type": "function", "function": {"name": "f", "parameters": "{}"}}],
     "tools[1].function.parameters must be a JSON Schema object", "tools[1].function.parameters"),
    ([WEATHER, TIME, WEATHER], "duplicate tool name 'get_weather'", "tools[2].function.name"),
    ([{"type": "function", "function": {"name": "f", "strict": "yes"}}], "strict must be a boolean",
     "tools[0].function.strict"),
])
def test_malformed_tools_are_refused(tools: list, needle: str, param: str) -> None:
    e = error(validate_tools, tools)
    assert needle in e.message and e.param == param


@pytest.mark.parametrize("choice,parser,needle,param", [
    ("sometimes", "qwen25", 'tool_choice must be "none", "auto", "required"', "tool_choice"),
    ({"type": "function", "function": {"name": "launch"}}, "qwen25", "'launch', which is not among", "tool_choice"),
    ({"type": "function"}, "qwen25", "tool_choice must be", "tool_choice"),
    ("auto", None, "start the server with --tool-call-parser", "tools"),
    (None, None, "start the server with --tool-call-parser", "tools"),
])
def test_tool_choice(choice: Any, parser: Any, needle: str, param: str) -> None:
    e = error(plan_tools, [WEATHER, TIME], choice, parser)
    assert needle in e.message and e.param == param


def test_tool_choice_none_and_auto() -> None:
    def req(**body: Any) -> ChatCompletionRequest:
        return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **body)

    for parser in (None, "qwen25"):  # "none" needs no parser: the tools are not rendered
        assert not plan_tools([WEATHER], "none", parser).parse
    assert template_tools(req(tools=[WEATHER], tool_choice="none")) is None
    plan = plan_tools([WEATHER, TIME], None, "qwen25")  # with tools, the default is "auto"
    assert plan.parse and plan.names == {"get_weather", "get_time"}
    assert template_tools(req(tools=[WEATHER, TIME])) == template_tools(req(tools=[WEATHER, TIME], tool_choice="auto"))
    assert template_tools(req(tools=[WEATHER, TIME])) == [WEATHER, TIME]
    assert template_tools(req()) is None and template_tools(req(tools=[])) is None
    assert not plan_tools(None, None, None).parse and not plan_tools([], "auto", None).parse
    assert 'tool_choice "required" needs tools' in error(plan_tools, None, "required", "qwen25").message


# ---------------------------------------------------------------------------- forced calls: the request
STRICT = {"type": "function", "function": {"name": "set_unit", "strict": True, "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["unit"],
    "additionalProperties": False}}}
NAMED_TIME = {"type": "function", "function": {"name": "get_time"}}


def test_named_function_is_constrained_to_its_arguments() -> None:
    plan = plan_tools([WEATHER, TIME], NAMED_TIME, None)  # no parser needed: the output is the JSON itself
    assert not plan.parse and plan.forced == ForcedCalls(function="get_time")
    # No parameters: any object. The constraint's errors name the schema's field.
    assert json.loads(plan.constraint.spec.value) == {"type": "object"} and plan.constraint.spec.kind == "json_schema"
    assert plan.constraint.field == "tools[1].function.parameters" and "get_time" in plan.constraint.what
    plan = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, "qwen25")
    assert json.loads(plan.constraint.spec.value) == WEATHER["function"]["parameters"]
    # An object schema without its "type" gets it; another type is not a call's arguments.
    untyped = {"type": "function", "function": {"name": "f", "parameters": {"properties": {"x": {"type": "integer"}}}}}
    plan = plan_tools([untyped], {"type": "function", "function": {"name": "f"}}, None)
    assert json.loads(plan.constraint.spec.value) == {"properties": {"x": {"type": "integer"}}, "type": "object"}
    listed = {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
    e = error(plan_tools, [WEATHER, listed], {"type": "function", "function": {"name": "f"}}, None)
    assert "must describe an object" in e.message and e.param == "tools[1].function.parameters"


def test_required_is_an_array_of_calls_to_the_tools() -> None:
    plan = plan_tools([WEATHER, TIME], "required", None)
    assert not plan.parse and plan.forced == ForcedCalls(function=None)
    assert plan.constraint.field == "tools" and plan.constraint.what == 'tool_choice "required"'
    schema = json.loads(plan.constraint.spec.value)
    assert schema == forced_calls_schema([WEATHER, TIME])
    assert schema == {
        "type": "array", "minItems": 1,
        "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"enum": ["get_weather"]}, "parameters": {"$ref": "#/$defs/tool0"}},
             "required": ["name", "parameters"], "additionalProperties": False},
            {"type": "object", "properties": {"name": {"enum": ["get_time"]}, "parameters": {"$ref": "#/$defs/tool1"}},
             "required": ["name", "parameters"], "additionalProperties": False}]},
        # No parameters: any object (said outright: see forced_calls_schema).
        "$defs": {"tool0": WEATHER["function"]["parameters"], "tool1": {"type": "object", "additionalProperties": True}},
    }
    # parallel_tool_calls false: exactly one call.
    assert json.loads(plan_tools([WEATHER], "required", None, parallel_tool_calls=False).constraint.spec.value)[
        "maxItems"] == 1


def test_required_rebases_each_tools_refs() -> None:
    params = {"type": "object", "$defs": {"P": {"type": "object", "properties": {"x": {"$ref": "#/$defs/P"}}}},
              "properties": {"p": {"$ref": "#/$defs/P"}, "self": {"$ref": "#"}, "enum": {"$ref": "#/properties/p"},
                             "list": {"type": "array", "items": {"$ref": "#/$defs/P"}}},
              "default": {"$ref": "#/data/is/kept"}}
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    rebased = forced_calls_schema([WEATHER, tool])["$defs"]["tool1"]
    assert rebased == {"type": "object",
                       "$defs": {"P": {"type": "object", "properties": {"x": {"$ref": "#/$defs/tool1/$defs/P"}}}},
                       "properties": {"p": {"$ref": "#/$defs/tool1/$defs/P"}, "self": {"$ref": "#/$defs/tool1"},
                                      "enum": {"$ref": "#/$defs/tool1/properties/p"},
                                      "list": {"type": "array", "items": {"$ref": "#/$defs/tool1/$defs/P"}}},
                       "default": {"$ref": "#/data/is/kept"}}


def test_strict_tools_are_kept_where_the_output_is_constrained() -> None:
    for choice in ("required", {"type": "function", "function": {"name": "set_unit"}}):
        assert plan_tools([WEATHER, STRICT], choice, None).forced is not None
    assert not plan_tools([STRICT], "none", None).parse  # no call is made: nothing to keep
    for choice in ("auto", None):  # parsed as without strict, and constrained by a structural tag
        plan = plan_tools([WEATHER, STRICT], choice, "qwen25")
        assert plan.parse and plan.forced is None and plan.constraint.spec.kind == "structural_tag"
        assert plan.constraint.field == "tools[1].function.parameters"  # the one strict tool's schema
        assert plan.constraint.asked_by == "tools[1].function.strict"
        # Still a 400 where the parser's calls cannot be held (llama3's have no marker), saying why.
        e = error(plan_tools, [WEATHER, STRICT], choice, "llama3")
        assert e.param == "tools[1].function.strict" and "no marker of their own" in e.message
        assert 'tool_choice "required" or a named function' in e.message
        # Without a parser the tools are refused as without strict.
        assert "--tool-call-parser" in error(plan_tools, [WEATHER, STRICT], choice, None).message
    assert template_tools(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[STRICT])) == [STRICT]


def test_forced_calls_are_rendered_and_read_without_the_reasoning_parser() -> None:
    def spec(**body: Any) -> OutputSpec:
        req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER, TIME], **body)
        return output_spec(req, "qwen25", "deepseek-r1")

    named = spec(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.forced == ForcedCalls("get_time") and named.reasoning is None and named.tool_format is None
    assert not named.plain
    required = spec(tool_choice="required")
    assert required.forced == ForcedCalls(None) and required.tool_names == {"get_weather", "get_time"}
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER], tool_choice="required")
    assert template_tools(req) == [WEATHER]


@pytest.fixture(scope="module")
def grammar():
    """xgrammar's matcher over the echo checkpoint's tokenizer: `accepts(schema, text)`."""
    xgr = pytest.importorskip("xgrammar")
    from echo_checkpoint import build_echo_tokenizer

    from sglang.srt.constrained.backends import create_grammar_backend
    from sglang.srt.sampling.grammar_spec import GrammarSpec

    tok = build_echo_tokenizer()
    backend = create_grammar_backend("xgrammar", tok, len(tok), [tok.convert_tokens_to_ids("<|im_end|>")])

    def accepts(schema: dict, text: str) -> bool:
        m = xgr.GrammarMatcher(backend.compile(GrammarSpec("json_schema", json.dumps(schema))))
        return m.accept_string(text) and m.is_completed()

    return accepts


def test_forced_schemas_compile_and_constrain(grammar) -> None:
    named = json.loads(plan_tools([WEATHER, STRICT], {"type": "function", "function": {"name": "set_unit"}},
                                  None).constraint.spec.value)
    assert grammar(named, '{"unit": "celsius"}')
    for bad in ('{"unit": "kelvin"}', '{}', '{"unit": "celsius", "x": 1}', '[{"unit": "celsius"}]', "celsius"):
        assert not grammar(named, bad), bad
    required = forced_calls_schema([WEATHER, STRICT, TIME])
    assert grammar(required, '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
                             '{"name": "set_unit", "parameters": {"unit": "fahrenheit"}}, {"name": "get_time", '
                             '"parameters": {"any": ["thing"]}}]')
    for bad in ('[]', '{"name": "get_time", "parameters": {}}', '[{"name": "launch", "parameters": {}}]',
                '[{"name": "set_unit", "parameters": {"unit": "kelvin"}}]', '[{"name": "get_time"}]',
                '[{"parameters": {}, "name": "get_time"}]', 'I will call get_time.'):
        assert not grammar(required, bad), bad
    one = forced_calls_schema([WEATHER, TIME], parallel_tool_calls=False)
    assert grammar(one, '[{"name": "get_time", "parameters": {}}]')
    assert not grammar(one, '[{"name": "get_time", "parameters": {}}, {"name": "get_time", "parameters": {}}]')
    # A tool's own $defs and recursive refs, rebased under the root's $defs, still resolve.
    tree = {"type": "function", "function": {"name": "tree", "parameters": {
        "type": "object", "properties": {"label": {"$ref": "#/$defs/Label"}, "child": {"$ref": "#"}},
        "required": ["label"], "$defs": {"Label": {"type": "string", "enum": ["a", "b"]}}}}}
    schema = forced_calls_schema([WEATHER, tree])
    assert grammar(schema, '[{"name": "tree", "parameters": {"label": "a", "child": {"label": "b"}}}]')
    assert not grammar(schema, '[{"name": "tree", "parameters": {"label": "a", "child": {"label": "c"}}}]')


def msg(**fields: Any) -> ChatMessage:
    return ChatMessage(**fields)


def test_message_tool_fields() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    out = message_tool_fields(1, msg(role="assistant", content=None, tool_calls=[call]))
    # Templates write `arguments | tojson`: they get the object, not the string.
    assert out == {"tool_calls": [{"id": "call_1", "type": "function",
                                   "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert message_tool_fields(2, msg(role="tool", content="18C", tool_call_id="call_1")) == {"tool_call_id": "call_1"}
    assert message_tool_fields(0, msg(role="user", content="hi")) == {}
    assert message_tool_fields(0, msg(role="assistant", content="x", reasoning_content="r")) == {"reasoning_content": "r"}


@pytest.mark.parametrize("fields,needle,param", [
    (dict(role="tool", content="18C"), "tool_call_id is required for role 'tool'", "messages[3].tool_call_id"),
    (dict(role="tool", content="18C", tool_call_id=""), "tool_call_id is required", "messages[3].tool_call_id"),
    (dict(role="user", content="x", tool_calls=[]), "only allowed on assistant messages", "messages[3].tool_calls"),
    (dict(role="assistant", tool_calls=[{"type": "function", "function": {"name": "f", "arguments": "{}"}}]),
     "tool_calls[0].id must be a non-empty string", "messages[3].tool_calls[0].id"),
    (dict(role="assistant", tool_calls=[{"id": "c", "function": {"arguments": "{}"}}]),
     "must be an object with a non-empty name", "messages[3].tool_calls[0].function"),
    (dict(role="assistant", tool_calls=[{"id": "c", "function": {"name": "f", "arguments": "{not json"}}]),
     "arguments must be a JSON object encoded as a string", "messages[3].tool_calls[0].function.arguments"),
    (dict(role="assistant", tool_calls=[{"id": "c", "function": {"name": "f", "arguments": "[1, 2]"}}]),
     "arguments must be a JSON object", "messages[3].tool_calls[0].function.arguments"),
    (dict(role="assistant", tool_calls=["c"]), "tool_calls[0] must be an object", "messages[3].tool_calls[0]"),
])
def test_bad_tool_messages(fields: dict, needle: str, param: str) -> None:
    e = error(message_tool_fields, 3, msg(**fields))
    assert needle in e.message and e.param == param


def test_output_spec() -> None:
    def spec(parser: str, **body: Any) -> OutputSpec:
        req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **body)
        return output_spec(req, "qwen25", parser)

    assert spec("qwen3").reasoning is REASONING_PARSERS["qwen3"] and spec("qwen3").tool_format is None
    # Qwen3's enable_thinking=false: the template closed an empty block, nothing to separate.
    assert spec("qwen3", chat_template_kwargs={"enable_thinking": False}).reasoning is None
    assert spec("deepseek-r1", chat_template_kwargs={"enable_thinking": False}).reasoning is not None
    s = spec("qwen3", tools=[WEATHER], parallel_tool_calls=False, separate_reasoning=False)
    assert s.tool_names == {"get_weather"} and not s.parallel_tool_calls and not s.separate_reasoning
    assert spec("qwen3", tools=[WEATHER], tool_choice="none").tool_format is None


def test_special_markers_keep_special_tokens() -> None:
    from echo_checkpoint import build_echo_tokenizer  # [TOOL_CALLS], <|python_tag|> special; <tool_call> not

    special = special_tokens(build_echo_tokenizer())
    assert {"[TOOL_CALLS]", "<|python_tag|>", "<|im_end|>"} <= special and "<tool_call>" not in special
    for parser, needed in (("mistral", True), ("llama3", True), ("qwen25", False), ("qwen3_coder", False)):
        assert needs_special_tokens(OutputSpec(tool_format=tool_call_format(parser)), special) is needed
    assert not needs_special_tokens(OutputSpec(reasoning=REASONING_PARSERS["qwen3"]), special)


# ---------------------------------------------------------------------------- reply side
BOTH = OutputSpec(reasoning=REASONING_PARSERS["qwen3"], tool_format=tool_call_format("qwen25"),
                  tool_names=frozenset({"get_weather"}))
REPLY = ('<think>\nI need the weather. Not <tool_call>{"name": "get_weather", "arguments": {}}</tool_call> yet.\n'
         '</think>\n\nLet me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


def streamed(spec: OutputSpec, chunks: list[str]) -> list:
    parser = spec.parser()
    parts = [p for c in chunks for p in parser.feed(c)] + parser.finish()
    merged: list = []
    for p in parts:
        if isinstance(p, TextPart) and merged and isinstance(merged[-1], TextPart) and merged[-1].kind == p.kind:
            merged[-1] = TextPart(p.kind, merged[-1].text + p.text)
        else:
            merged.append(p)
    return [(p.kind, p.text) if isinstance(p, TextPart) else ("call", p.name, p.arguments) for p in merged]


def test_reasoning_then_tool_calls() -> None:
    parsed = BOTH.parser().parse(REPLY)
    # A call written inside the reasoning is reasoning; calls are read from the content after it.
    assert parsed.reasoning_content == ('I need the weather. Not <tool_call>{"name": "get_weather", "arguments": {}}'
                                        '</tool_call> yet.')
    assert parsed.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert all(c.id.startswith("call_") and len(c.id) > 10 for c in parsed.tool_calls)
    whole = streamed(BOTH, [REPLY])
    assert whole == [("reasoning", parsed.reasoning_content), ("content", "Let me check."),
                     ("call", "get_weather", '{"city": "Paris"}')]
    for k in range(len(REPLY) + 1):
        assert streamed(BOTH, [REPLY[:k], REPLY[k:]]) == whole, k
    assert streamed(BOTH, list(REPLY)) == whole


def test_only_calls_give_null_content() -> None:
    parsed = BOTH.parser().parse('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    assert parsed.content is None and parsed.reasoning_content is None and len(parsed.tool_calls) == 1
    parsed = BOTH.parser().parse("")  # an empty reply without calls keeps its (empty) content
    assert parsed.content == "" and parsed.tool_calls == []


def test_separate_reasoning_false_keeps_the_reply_verbatim() -> None:
    spec = OutputSpec(reasoning=REASONING_PARSERS["qwen3"], separate_reasoning=False)
    text = "<think>\nHmm.\n</think>\n\nAnswer."
    parsed = spec.parser().parse(text)
    assert parsed.content == text and parsed.reasoning_content is None
    for k in range(len(text) + 1):
        assert streamed(spec, [text[:k], text[k:]]) == [("content", text)]
    # With tools, the calls after the reasoning are still read.
    spec = OutputSpec(reasoning=REASONING_PARSERS["qwen3"], separate_reasoning=False,
                      tool_format=tool_call_format("qwen25"), tool_names=frozenset({"get_weather"}))
    parsed = spec.parser().parse(REPLY)
    assert parsed.content == REPLY[:REPLY.index("Let me check.")] + "Let me check." and len(parsed.tool_calls) == 1


def test_stream_reasoning_false_sends_the_reasoning_in_one_piece() -> None:
    spec = OutputSpec(reasoning=REASONING_PARSERS["deepseek-r1"], stream_reasoning=False)
    parser = spec.parser()
    assert parser.feed("First, ") == [] and parser.feed("second.\n</th") == []
    assert parser.feed("ink>\n\nAnswer") == [TextPart("reasoning", "First, second."), TextPart("content", "Answer")]
    assert parser.finish() == []
    parser = spec.parser()
    assert parser.feed("never ends") == [] and parser.finish() == [TextPart("reasoning", "never ends")]


def test_qwen3_coder_calls_stream_typed_by_the_requests_tools() -> None:
    """output_spec gives the format the request's tools, whose schemas type the raw values; the
    call streams as ToolCallStart, then a ToolCallArguments per parameter, and adds up to the
    non-streamed reply."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=tools)
    spec = output_spec(req, "qwen3_coder", "qwen3")
    reply = ("<think>\nEasy.\n</think>\n\nChecking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n123\n"
             "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
    parsed = spec.parser().parse(reply)
    assert parsed.reasoning_content == "Easy." and parsed.content == "Checking."
    [call] = parsed.tool_calls
    assert call.name == "get_weather" and call.arguments == '{"city": "123", "days": 3}'  # "123": a string by its schema
    assert call.id.startswith("call_")
    parser = spec.parser()
    parts = [p for c in reply for p in parser.feed(c)] + parser.finish()
    calls = [p for p in parts if not isinstance(p, TextPart)]
    assert [type(p).__name__ for p in calls] == ["ToolCallStart"] + ["ToolCallArguments"] * 3
    assert "".join(p.text for p in calls[1:]) == call.arguments and parser.num_tool_calls == 1
    deltas = [d.model_dump() for d in part_deltas(calls, 0)]
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert all(d["tool_calls"][0]["index"] == 0 for d in deltas)


def test_part_deltas_number_the_calls_of_a_choice() -> None:
    parts = [TextPart("reasoning", "r"), TextPart("content", "c"), ToolCallPart("call_a", "f", '{"x": 1}'),
             ToolCallPart("call_b", "g", "{}")]
    deltas = [d.model_dump() for d in part_deltas(parts, first_call_index=2)]
    assert deltas == [
        {"reasoning_content": "r"}, {"content": "c"},
        {"tool_calls": [{"index": 2, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": ""}}]},
        {"tool_calls": [{"index": 2, "function": {"arguments": '{"x": 1}'}}]},
        {"tool_calls": [{"index": 3, "id": "call_b", "type": "function", "function": {"name": "g", "arguments": ""}}]},
        {"tool_calls": [{"index": 3, "function": {"arguments": "{}"}}]},
    ]


# ---------------------------------------------------------------------------- forced calls: the reply
NAMED = OutputSpec(forced=ForcedCalls("get_weather"), tool_names=frozenset({"get_weather", "get_time"}))
REQUIRED = OutputSpec(forced=ForcedCalls(None), tool_names=frozenset({"get_weather", "get_time"}))
ARGS = '{"city": "Paris", "days": [1, 2], "note": "a } in a string"}'
CALLS = ('[{"name": "get_weather", "parameters": {"city": "Paris", "note": "]}, {"}},\n'
         ' {"name": "get_time", "parameters": {}}]')


def calls_of(spec: OutputSpec, chunks: list[str]) -> tuple[list, list]:
    """The calls the streamed parts add up to (name, arguments) and the parts' kinds."""
    parser = spec.parser()
    parts = [p for c in chunks for p in parser.feed(c)] + parser.finish()
    calls: list = []
    for p in parts:
        if isinstance(p, (ToolCallPart, ToolCallStart)):
            calls.append([p.name, p.arguments if isinstance(p, ToolCallPart) else ""])
        elif isinstance(p, ToolCallArguments):
            calls[-1][1] += p.text
        else:
            raise AssertionError(f"forced calls give no text: {p}")
    assert parser.num_tool_calls == len(calls)
    return [tuple(c) for c in calls], [type(p).__name__ for p in parts]


def test_named_output_is_the_calls_arguments() -> None:
    parsed = NAMED.parser().parse(ARGS)
    assert parsed.content is None and parsed.reasoning_content is None
    [call] = parsed.tool_calls
    assert call.name == "get_weather" and call.arguments == ARGS and call.id.startswith("call_") and len(call.id) == 29
    for k in range(len(ARGS) + 1):
        assert calls_of(NAMED, [ARGS[:k], ARGS[k:]])[0] == [("get_weather", ARGS)], k
    # Streamed: the call first, then its arguments as they come (white space around them dropped).
    calls, kinds = calls_of(NAMED, ["", " \n", "{", '"city"', ": ", '"Paris"', "}", "\n"])
    assert calls == [("get_weather", '{"city": "Paris"}')]
    assert kinds == ["ToolCallStart", "ToolCallArguments"] + ["ToolCallArguments"] * 4
    # Cut before anything was written: still the one call, without arguments.
    assert calls_of(NAMED, [""])[0] == [("get_weather", "")]


def test_required_output_is_the_arrays_calls() -> None:
    parsed = REQUIRED.parser().parse(CALLS)
    assert parsed.content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris", "note": "]}, {"}), ("get_time", {})]
    assert len({c.id for c in parsed.tool_calls}) == 2
    whole = calls_of(REQUIRED, [CALLS])[0]
    assert whole == [("get_weather", '{"city": "Paris", "note": "]}, {"}'), ("get_time", "{}")]
    for k in range(len(CALLS) + 1):
        assert calls_of(REQUIRED, [CALLS[:k], CALLS[k:]])[0] == whole, k
    assert calls_of(REQUIRED, list(CALLS))[0] == whole
    # Each call as soon as its item closes.
    parser = REQUIRED.parser()
    first = CALLS.index("},\n") + 2
    assert [p.name for p in parser.feed(CALLS[:first])] == ["get_weather"] and parser.feed(CALLS[first:-3]) == []
    assert [p.name for p in parser.feed(CALLS[-3:])] == ["get_time"] and parser.finish() == []
    # Cut short (max_tokens): the items that closed, not the open one.
    assert calls_of(REQUIRED, [CALLS[:-5]])[0] == whole[:1]
    assert REQUIRED.parser().parse("[").tool_calls == [] and REQUIRED.parser().parse("").content == ""


def test_part_deltas_of_a_started_call_across_steps() -> None:
    step1 = [d.model_dump() for d in part_deltas([ToolCallStart("call_a", "f"), ToolCallArguments('{"x"')], 0)]
    step2 = [d.model_dump() for d in part_deltas([ToolCallArguments(": 1}")], 1)]
    assert step1 == [
        {"tool_calls": [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"x"'}}]},
    ]
    assert step2 == [{"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}]
