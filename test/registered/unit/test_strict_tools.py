"""`strict: true` tools under tool_choice "auto" without a server (strict_tools.py, chat_tools.py,
structured_outputs.py): the structural tag built for each --tool-call-parser, compiled by the
xgrammar backend over the echo checkpoint's tokenizer and fed replies token by token through a
GrammarMatcher (free text and valid calls accepted; wrong-typed, extra and missing arguments,
unknown tools and a second call where parallel_tool_calls is false rejected); what the grammar lets
through is what the parser reads as calls; the reasoning block stays free; and the request side:
one constraint per request, constrained decoding off, each strict schema checked in its own field.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any, Optional

import pytest

from sglang.srt.entrypoints.openai.chat_output import OutputSpec
from sglang.srt.entrypoints.openai.chat_tools import plan_tools
from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
from sglang.srt.entrypoints.openai.reasoning_parser import REASONING_PARSERS
from sglang.srt.entrypoints.openai.strict_tools import ANY_OBJECT, ToolGrammar, strict_tools_tag
from sglang.srt.entrypoints.openai.structured_outputs import add_constraint
from sglang.srt.entrypoints.openai.tool_parsers import CallStart, ParsedCall, ToolCallStream, tool_call_format
from sglang.srt.managers.generate_request import InvalidRequestError
from sglang.srt.sampling.grammar_spec import GrammarSpec

FORECAST = {"type": "function", "function": {"name": "forecast", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"], "additionalProperties": False}}}
NOTE = {"type": "function", "function": {"name": "note", "parameters": {  # not strict
    "type": "object", "properties": {"text": {"type": "string"}}}}}
TOOLS = [FORECAST, NOTE]


def hermes(name: str, args: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def coder(name: str, params: dict[str, str], wrapped: bool = True) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    call = f"<function={name}>\n{body}</function>"
    return f"<tool_call>\n{call}\n</tool_call>" if wrapped else call


def mistral_array(*calls: tuple[str, Any]) -> str:
    return "[TOOL_CALLS] " + json.dumps([{"name": n, "arguments": a} for n, a in calls])


def mistral_named(name: str, args: Any) -> str:
    return f"[TOOL_CALLS]{name}[ARGS]" + json.dumps(args)


# ---------------------------------------------------------------------------- the tag's shape
def test_each_parser_triggers_on_its_call_marker() -> None:
    tools = [ToolGrammar("forecast", {"type": "object"}), ToolGrammar("note", ANY_OBJECT)]
    tag = strict_tools_tag("hermes", tools)
    assert tag["type"] == "structural_tag" and tag["format"]["triggers"] == ["<tool_call>"]
    assert [t["begin"] for t in tag["format"]["tags"]] == [
        '<tool_call>\n{"name": "forecast", "arguments": ', '<tool_call>\n{"name": "note", "arguments": ']
    assert tag["format"]["tags"][0]["content"]["excludes"] == ["</tool_call>"]
    coder_tag = strict_tools_tag("qwen3_coder", tools)["format"]
    assert coder_tag["triggers"] == ["<tool_call>", "<function="]
    assert coder_tag["tags"][0]["content"]["style"] == "qwen_xml"
    assert [t["begin"] for t in coder_tag["tags"]] == ["<tool_call>\n<function=forecast>\n",
                                                       "<tool_call>\n<function=note>\n", "<function=forecast>\n",
                                                       "<function=note>\n"]
    mistral = strict_tools_tag("mistral", tools, parallel_tool_calls=False)["format"]
    assert mistral["triggers"] == ["[TOOL_CALLS]"] and mistral["stop_after_first"]
    assert [t["begin"] for t in mistral["tags"]] == ["[TOOL_CALLS] [", "[TOOL_CALLS][", "[TOOL_CALLS]forecast[ARGS]",
                                                     "[TOOL_CALLS]note[ARGS]"]
    with pytest.raises(ValueError, match="no marker of their own"):
        strict_tools_tag("llama3", tools)


# ---------------------------------------------------------------------------- xgrammar's matcher
@pytest.fixture(scope="module")
def grammar():
    """`accepts(parser, text, ...)`: whether the reply `text`, tokenised by the echo checkpoint's
    tokenizer, is accepted token by token under the structural tag of TOOLS and then may end
    (its end-of-turn token accepted)."""
    xgr = pytest.importorskip("xgrammar")
    from echo_checkpoint import END_OF_TURN, build_echo_tokenizer

    from sglang.srt.constrained.backends import create_grammar_backend

    tok = build_echo_tokenizer()
    eot = tok.convert_tokens_to_ids(END_OF_TURN)
    backend = create_grammar_backend("xgrammar", tok, len(tok), [tok.eos_token_id, eot])
    compiled: dict[tuple, Any] = {}

    def accepts(parser: str, text: str, parallel: bool = True, reasoning: Optional[str] = None) -> bool:
        key = (parser, parallel, reasoning)
        if key not in compiled:
            plan = plan_tools(TOOLS, "auto", parser, parallel,
                              REASONING_PARSERS[reasoning] if reasoning is not None else None)
            compiled[key] = backend.compile(plan.constraint.spec)
        m = xgr.GrammarMatcher(compiled[key])
        ok = all(m.accept_token(t) for t in tok.encode(text, add_special_tokens=False))
        return ok and m.accept_token(eot) and m.is_terminated()

    return accepts


PROSE = "Let me look that up. "
HERMES_GOOD = [
    "No tools needed: it is sunny.",
    "",
    PROSE + hermes("forecast", {"city": "Paris"}),
    PROSE + hermes("forecast", {"city": "Paris", "days": 3}) + "\n" + hermes("note", {"anything": [1, {"x": None}]}),
    hermes("note", {}) + " and some text after",
]
HERMES_BAD = [
    PROSE + hermes("forecast", {"city": "Paris", "days": "3"}),  # wrong type
    PROSE + hermes("forecast", {"city": "Paris", "hours": 3}),  # an argument the schema does not list
    PROSE + hermes("forecast", {"days": 3}),  # a required one missing
    PROSE + hermes("forecast", {"city": 7}),
    PROSE + hermes("launch", {}),  # not a tool: after the marker, only the tools' calls
    PROSE + "<tool_call>\nI changed my mind",
    PROSE + hermes("forecast", {"city": "a</tool_call>b"}),  # would end the call early for the parser
    PROSE + hermes("note", ["not", "an", "object"]),  # a tool without strict still takes an object
    PROSE + '<tool_call>\n{"name": "forecast", "arguments": {"city": "Paris"}',  # cut off: cannot end there
]


@pytest.mark.parametrize("text", HERMES_GOOD)
def test_hermes_accepts_free_text_and_valid_calls(grammar, text: str) -> None:
    assert grammar("qwen25", text)


@pytest.mark.parametrize("text", HERMES_BAD)
def test_hermes_rejects_invalid_calls(grammar, text: str) -> None:
    assert not grammar("qwen25", text)


def test_parallel_tool_calls_false_ends_the_reply_after_the_first_call(grammar) -> None:
    one = PROSE + hermes("forecast", {"city": "Paris"})
    assert grammar("qwen25", one, parallel=False)
    assert not grammar("qwen25", one + hermes("note", {}), parallel=False)
    assert not grammar("qwen25", one + " then more text", parallel=False)


def test_qwen3_coder_holds_its_xml_parameters_to_the_schema(grammar) -> None:
    assert grammar("qwen3_coder", PROSE + coder("forecast", {"city": "Paris", "days": "3"}))
    assert grammar("qwen3_coder", coder("note", {"whatever": "free text"}) + " done")
    assert grammar("qwen3_coder", "Just text.")
    # a call written without its <tool_call> block (the parser reads it too) is held the same
    assert grammar("qwen3_coder", PROSE + coder("forecast", {"city": "Paris", "days": "3"}, wrapped=False) + " ok")
    for wrapped in (True, False):
        for bad in (coder("forecast", {"city": "Paris", "days": "three"}, wrapped),
                    coder("forecast", {"days": "3"}, wrapped),
                    coder("forecast", {"city": "Paris", "hours": "3"}, wrapped),
                    coder("launch", {}, wrapped), coder("forecast", {"city": "a</tool_call>"}, wrapped)):
            assert not grammar("qwen3_coder", PROSE + bad), bad


def test_mistral_holds_both_syntaxes(grammar) -> None:
    assert grammar("mistral", PROSE + mistral_array(("forecast", {"city": "Paris"}), ("note", {"x": 1})))
    assert grammar("mistral", mistral_named("forecast", {"city": "Paris", "days": 2}) + mistral_named("note", {}))
    assert grammar("mistral", "Nothing to call.")
    for bad in (mistral_array(("forecast", {"city": "Paris", "days": 2.5})), mistral_named("forecast", {"town": "x"}),
                mistral_array(("launch", {})), "[TOOL_CALLS] not a call"):
        assert not grammar("mistral", PROSE + bad), bad
    assert not grammar("mistral", mistral_array(("note", {}), ("note", {})), parallel=False)


@pytest.mark.parametrize("reasoning, opened", [("qwen3", "<think>"), ("deepseek-r1", "")])
def test_the_reasoning_block_is_free_and_the_calls_after_it_are_held(grammar, reasoning: str, opened: str) -> None:
    wrong = hermes("forecast", {"city": "Paris", "days": "3"})
    right = hermes("forecast", {"city": "Paris", "days": 3})
    # A call written while thinking is reasoning (the parser does not read it): it is not held.
    assert grammar("qwen25", opened + "Maybe " + wrong + "?</think>\n\n" + right, reasoning=reasoning)
    assert not grammar("qwen25", opened + "Hmm.</think>\n\n" + wrong, reasoning=reasoning)
    assert grammar("qwen25", opened + "thinking that never ends " + wrong, reasoning=reasoning)
    if not opened:  # the template opened the block: the reply is inside it until </think>
        assert grammar("qwen25", "Sure. " + wrong + "</think>ok", reasoning=reasoning)
    else:  # qwen3: a reply may open no block, and its calls are held from the start
        assert not grammar("qwen25", "No thinking. " + wrong, reasoning=reasoning)
        assert grammar("qwen25", "No thinking. " + right, reasoning=reasoning)


# ---------------------------------------------------------------------------- what the parser reads
@pytest.mark.parametrize("parser, text, calls", [
    ("qwen25", PROSE + hermes("forecast", {"city": "Paris", "days": 3}), [("forecast", {"city": "Paris", "days": 3})]),
    ("qwen3_coder", PROSE + coder("forecast", {"city": "Paris", "days": "3"}),
     [("forecast", {"city": "Paris", "days": 3})]),
    ("qwen3_coder", PROSE + coder("forecast", {"city": "Paris", "days": "3"}, wrapped=False),
     [("forecast", {"city": "Paris", "days": 3})]),
    ("mistral", PROSE + mistral_array(("forecast", {"city": "Paris"}), ("note", {"text": "hi"})),
     [("forecast", {"city": "Paris"}), ("note", {"text": "hi"})]),
    ("mistral", PROSE + mistral_named("forecast", {"city": "Oslo"}), [("forecast", {"city": "Oslo"})]),
])
def test_what_the_grammar_accepts_the_parser_reads_as_calls(grammar, parser: str, text: str, calls: list) -> None:
    assert grammar(parser, text)
    spec = OutputSpec(tool_format=tool_call_format(parser, TOOLS), tool_names=frozenset({"forecast", "note"}))
    reply = spec.parser().parse(text)
    assert reply.content == PROSE.strip()
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == calls


# ---------------------------------------------------------------------------- the request side
class FakeTM:
    """The tokenizer manager as add_constraint sees it: its grammar backend, and the door check
    (recorded; `bad` specs refused as the real check refuses them)."""

    def __init__(self, backend: str = "xgrammar", bad: tuple[str, ...] = ()) -> None:
        self.config = SimpleNamespace(grammar_backend=backend)
        self.checked: list[tuple[str, str]] = []
        self.bad = bad

    async def check_grammar(self, spec: GrammarSpec, param: str) -> None:
        self.checked.append((spec.kind, param))
        if param in self.bad:
            raise InvalidRequestError(f"Invalid {spec.kind} in '{param}'", param=param)


def constrain(tm: FakeTM, tools: list, **extra: Any) -> dict[str, Any]:
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=tools, **extra)
    plan = plan_tools(req.tools, req.tool_choice, "qwen25")
    params: dict[str, Any] = {}
    asyncio.run(add_constraint(tm, req, params, plan.constraint))
    return params


def test_the_structural_tag_is_the_requests_constraint_each_strict_schema_checked_in_its_field() -> None:
    strict_note = {"type": "function", "function": {**NOTE["function"], "strict": True}}
    tm = FakeTM()
    params = constrain(tm, [FORECAST, strict_note])
    assert json.loads(params["structural_tag"])["type"] == "structural_tag"
    assert tm.checked == [("json_schema", "tools[0].function.parameters"),
                          ("json_schema", "tools[1].function.parameters"), ("structural_tag", "tools")]
    with pytest.raises(InvalidRequestError) as e:
        constrain(FakeTM(bad=("tools[1].function.parameters",)), [FORECAST, strict_note])
    assert e.value.param == "tools[1].function.parameters"
    assert constrain(FakeTM(), [NOTE]) == {}  # no strict tool: no constraint, as before


@pytest.mark.parametrize("backend, extra, param, fragment", [
    ("xgrammar", {"response_format": {"type": "json_object"}}, "response_format",
     'response_format cannot be combined with tool_choice "auto" with strict tools'),
    ("none", {}, "tools[0].function.strict", "needs constrained decoding, which is off on this server"),
])
def test_refused_beside_another_constraint_and_without_a_backend(backend: str, extra: dict, param: str,
                                                                 fragment: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        constrain(FakeTM(backend), [FORECAST, NOTE], **extra)
    assert e.value.param == param and fragment in e.value.message, e.value.message


def _spelled(parser: str, name: str) -> list[str]:
    """A call to `name` with no arguments, as each of the parser's tags spells it."""
    if parser == "qwen25":
        return [hermes(name, {})]
    if parser == "qwen3_coder":
        return [coder(name, {}), coder(name, {}, wrapped=False)]
    return [mistral_array((name, {})), mistral_named(name, {})]


def _reads_back(parser: str, name: str, tools: list, text: str) -> bool:
    """Whether the parser reads `text` as one call to `name`, whole and streamed a character at a time."""
    names = frozenset(t["function"]["name"] for t in tools)
    whole = OutputSpec(tool_format=tool_call_format(parser, tools), tool_names=names).parser().parse(text)
    stream = ToolCallStream(tool_call_format(parser, tools), names)
    events = [e for c in text for e in stream.feed(c)] + stream.finish()
    streamed = [e.name for e in events if isinstance(e, (ParsedCall, CallStart))]
    return [c.name for c in whole.tool_calls] == [name] and streamed == [name]


@pytest.mark.parametrize("parser, name", [
    ("qwen25", "a</tool_call>b"),  # the parser ends the call at the first </tool_call>
    ("qwen3_coder", "a>b"), ("qwen3_coder", "a\nb"), ("qwen3_coder", " f"),  # read up to ">", stripped
    # Read up to [ARGS] or [CALL_ID], stripped; "[" opens an array.
    ("mistral", "a[ARGS]b"), ("mistral", "a[CALL_ID]b"), ("mistral", "f "), ("mistral", "[f]"),
])
def test_a_tool_name_the_parser_cannot_read_back_is_refused(parser: str, name: str) -> None:
    """Under strict the grammar makes the model write the call, tool name and all; a name the parser
    cannot read back would come out as content (marker and all), so it is a 400 naming the tool."""
    odd = {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    # Why it is refused: a spelling the grammar allows is not read back as the call.
    assert not all(_reads_back(parser, name, [FORECAST, odd], text) for text in _spelled(parser, name))
    with pytest.raises(InvalidRequestError) as e:
        plan_tools([FORECAST, odd], "auto", parser)
    assert e.value.param == "tools[1].function.name" and "cannot read back" in e.value.message, e.value.message
    # Without strict nothing is constrained: the tools are taken as before.
    plan_tools([{"type": "function", "function": {**FORECAST["function"], "strict": False}}, odd], "auto", parser)


@pytest.mark.parametrize("parser, name", [
    ("qwen25", "天気 <b>"), ("qwen25", 'a"b\n'), ("qwen3_coder", "天気"), ("qwen3_coder", "a b"),
    ("mistral", "x y"), ("mistral", "f]"),
])
def test_odd_tool_names_the_parser_reads_back_are_kept(parser: str, name: str) -> None:
    odd = {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for text in _spelled(parser, name):
        assert _reads_back(parser, name, [FORECAST, odd], text), text
    assert plan_tools([FORECAST, odd], "auto", parser).constraint is not None
