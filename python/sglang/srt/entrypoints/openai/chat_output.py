"""A chat reply's text split into reasoning, content and tool calls, whole or as it streams.

`OutputSpec` is what one request asks for (built by chat_tools.output_spec); `spec.parser()` gives
one choice's `ChatOutputParser`. Text goes through the reasoning parser first; tool calls are read
from the content after the reasoning only. `feed` returns the parts that became final, in order;
a non-streamed reply is one `feed` and `finish`, so it is what the streamed parts add up to.

Under tool_choice "required" or a named function (`spec.forced`) the output was constrained to
the calls' JSON (chat_tools.forced_calls_schema), and it is read as that JSON, with neither the
model family's tool-call parser nor the reasoning parser: a named function's output is its
arguments, streamed as they come (a ToolCallStart, then ToolCallArguments); "required"'s array
gives a whole ToolCallPart per item as the item closes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from sglang.srt.entrypoints.openai.protocol import ChatResponseMessage, DeltaMessage
from sglang.srt.entrypoints.openai.protocol_tools import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from sglang.srt.entrypoints.openai.reasoning_parser import ReasoningFormat, ReasoningStream
from sglang.srt.entrypoints.openai.tool_parsers import ParsedCall, ToolCallFormat, ToolCallStream
from sglang.srt.entrypoints.openai.tool_parsers.base import (
    CallArguments,
    CallStart,
    JsonSpan,
    call_from_object,
    loads,
    new_call_id,
)


@dataclass(frozen=True)
class ToolCallPart:
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallStart:
    """A call whose arguments follow, in ToolCallArguments parts."""

    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArguments:
    text: str  # more of the arguments of the call started last


@dataclass(frozen=True)
class TextPart:
    kind: str  # "reasoning" or "content"
    text: str


Part = Union[TextPart, ToolCallPart, ToolCallStart, ToolCallArguments]


@dataclass(frozen=True)
class ForcedCalls:
    """tool_choice "required" (`function` None) or naming `function`: the output is the calls' JSON."""

    function: Optional[str]


@dataclass(frozen=True)
class OutputSpec:
    reasoning: Optional[ReasoningFormat] = None
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    tool_format: Optional[ToolCallFormat] = None
    tool_names: frozenset[str] = frozenset()
    parallel_tool_calls: bool = True
    forced: Optional[ForcedCalls] = None

    @property
    def plain(self) -> bool:
        """Nothing to parse: the text is the content."""
        return self.reasoning is None and self.tool_format is None and self.forced is None

    @property
    def calls_finish_reason(self) -> str:
        """The finish_reason of a reply that stopped with tool calls in it: "tool_calls", except
        under a tool_choice naming the function, where OpenAI's API says "stop" (stream or not;
        vLLM answers the same)."""
        return "stop" if self.forced is not None and self.forced.function is not None else "tool_calls"

    def parser(self) -> "ChatOutputParser":
        return ChatOutputParser(self)


@dataclass
class ParsedReply:
    """A whole reply: `content` None when the reply was only tool calls (OpenAI's convention)."""

    content: Optional[str]
    reasoning_content: Optional[str]
    tool_calls: list[ToolCallPart] = field(default_factory=list)


class ChatOutputParser:
    def __init__(self, spec: OutputSpec) -> None:
        self.spec = spec
        self.reasoning = ReasoningStream(spec.reasoning) if spec.reasoning is not None else None
        self.tools = (ToolCallStream(spec.tool_format, spec.tool_names, None if spec.parallel_tool_calls else 1)
                      if spec.tool_format is not None else None)
        self.forced: Optional[Union[NamedCallStream, CallArrayStream]] = None
        if spec.forced is not None:
            self.forced = (NamedCallStream(spec.forced.function) if spec.forced.function is not None
                           else CallArrayStream(spec.tool_names))
        self.num_tool_calls = 0
        self._held_reasoning = ""  # stream_reasoning false: the reasoning until it ends

    def feed(self, text: str) -> list[Part]:
        if self.forced is not None:
            return self._counted(self.forced.feed(text))
        return self._route(self.reasoning.feed(text) if self.reasoning else [("content", text)], final=False)

    def finish(self) -> list[Part]:
        if self.forced is not None:
            return self._counted(self.forced.finish())
        return self._route(self.reasoning.finish() if self.reasoning else [], final=True)

    def parse(self, text: str) -> ParsedReply:
        """A whole reply (this parser must be fresh)."""
        parts = self.feed(text) + self.finish()
        content = "".join(p.text for p in parts if isinstance(p, TextPart) and p.kind == "content")
        reasoning = "".join(p.text for p in parts if isinstance(p, TextPart) and p.kind == "reasoning")
        calls: list[ToolCallPart] = []
        for p in parts:
            if isinstance(p, ToolCallPart):
                calls.append(p)
            elif isinstance(p, ToolCallStart):
                calls.append(ToolCallPart(p.id, p.name, ""))
            elif isinstance(p, ToolCallArguments):
                last = calls[-1]
                calls[-1] = ToolCallPart(last.id, last.name, last.arguments + p.text)
        return ParsedReply(content=content if content or not calls else None,
                           reasoning_content=reasoning or None, tool_calls=calls)

    def _counted(self, parts: list[Part]) -> list[Part]:
        self.num_tool_calls += sum(isinstance(p, (ToolCallPart, ToolCallStart)) for p in parts)
        return parts

    def _route(self, events: list[tuple[str, str]], final: bool) -> list[Part]:
        out: list[Part] = []
        for kind, text in events:
            if kind == "content":
                out += self._content(self.tools.feed(text)) if self.tools else [TextPart("content", text)]
            elif not self.spec.separate_reasoning:  # the block stays in the content, tags and all
                out.append(TextPart("content", text))
            elif kind == "reasoning":
                if self.spec.stream_reasoning:
                    out.append(TextPart("reasoning", text))
                else:
                    self._held_reasoning += text
        if self._held_reasoning and (final or not self.reasoning.in_reasoning):
            out.insert(0, TextPart("reasoning", self._held_reasoning))
            self._held_reasoning = ""
        if final and self.tools:
            out += self._content(self.tools.finish())
        return _merged(out)

    def _content(self, events: list[Union[str, ParsedCall, CallStart, CallArguments]]) -> list[Part]:
        out: list[Part] = []
        for e in events:
            if isinstance(e, str):
                out.append(TextPart("content", e))
            elif isinstance(e, CallStart):  # a format that streams its calls (qwen3_coder)
                out.append(ToolCallStart(self.spec.tool_format.new_call_id(), e.name))
                self.num_tool_calls += 1
            elif isinstance(e, CallArguments):
                out.append(ToolCallArguments(e.text))
            else:
                out.append(ToolCallPart(self.spec.tool_format.new_call_id(), e.name, e.arguments))
                self.num_tool_calls += 1
        return out


class NamedCallStream:
    """tool_choice naming `name`: the output is the call's arguments (a JSON object, by the
    constraint). The call starts at the first non-white-space character and its arguments stream
    as they come; white space around them is dropped (held back until more text follows), so the
    arguments are the output's text stripped, streamed or not. An output cut short (max_tokens)
    still gives the call, with the arguments written so far: finish_reason "length" says so."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = False
        self.held_ws = ""

    def feed(self, text: str) -> list[Part]:
        out: list[Part] = []
        if not self.started:
            text = text.lstrip()
            if not text:
                return out
            self.started = True
            out.append(ToolCallStart(new_call_id(), self.name))
        text = self.held_ws + text
        body = text.rstrip()
        self.held_ws = text[len(body):]
        if body:
            out.append(ToolCallArguments(body))
        return out

    def finish(self) -> list[Part]:
        if self.started:
            return []
        self.started = True  # nothing was written (cut at once): the call, without arguments
        return [ToolCallStart(new_call_id(), self.name)]


class CallArrayStream:
    """tool_choice "required": the output is a JSON array of `{"name", "parameters"}` items (by the
    constraint); each item becomes a call as soon as it closes, its arguments the `parameters`
    re-serialised (as the tool-call parsers serialise theirs). An item cut short (max_tokens) is
    dropped: finish_reason "length" says the reply was cut."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        self.text = ""
        self.pos = 0  # how far the text is read
        self.state = "open"  # open -> between <-> item -> done
        self.span: Optional[JsonSpan] = None
        self.item_start = 0

    def feed(self, text: str) -> list[Part]:
        self.text += text
        text = self.text
        out: list[Part] = []
        while self.state != "done":
            if self.state != "item":  # white space (and, between items, their commas) is skipped
                skip = " \t\r\n," if self.state == "between" else " \t\r\n"
                while self.pos < len(text) and text[self.pos] in skip:
                    self.pos += 1
            if self.pos >= len(text):
                break
            if self.state == "open":  # the constraint makes it "[": anything else is not read
                self.state = "between" if text[self.pos] == "[" else "done"
                self.pos += 1
            elif self.state == "between":  # an item's "{", or the array's "]"
                if text[self.pos] != "{":
                    self.state = "done"
                    break
                self.span, self.item_start, self.state = JsonSpan(self.pos), self.pos, "item"
            else:
                end = self.span.end(text)
                if end is None:
                    self.pos = len(text)
                    break
                call = call_from_object(loads(text[self.item_start:end]), self.names, ("parameters",))
                if call is not None:  # always, under the constraint
                    out.append(ToolCallPart(new_call_id(), call.name, call.arguments))
                self.pos, self.state, self.span = end, "between", None
        return out

    def finish(self) -> list[Part]:
        return []


def _merged(parts: list[Part]) -> list[Part]:
    out: list[Part] = []
    for p in parts:
        if isinstance(p, TextPart) and out and isinstance(out[-1], TextPart) and out[-1].kind == p.kind:
            out[-1] = TextPart(p.kind, out[-1].text + p.text)
        else:
            out.append(p)
    return out


# ---------------------------------------------------------------------------- as OpenAI's shapes
def reply_message(parsed: ParsedReply) -> ChatResponseMessage:
    calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in parsed.tool_calls]
    return ChatResponseMessage(content=parsed.content, reasoning_content=parsed.reasoning_content,
                               tool_calls=calls or None)


def part_deltas(parts: list[Part], first_call_index: int) -> list[DeltaMessage]:
    """One delta per text part; two per whole call (its id, type and name, then its arguments), the
    calls numbered from `first_call_index` (the calls the choice streamed before); a started call
    gives the first of them, and each of its ToolCallArguments a delta of the arguments."""
    out: list[DeltaMessage] = []
    k = first_call_index
    for p in parts:
        if isinstance(p, TextPart):
            out.append(DeltaMessage(reasoning_content=p.text) if p.kind == "reasoning" else DeltaMessage(content=p.text))
        elif isinstance(p, ToolCallStart):
            out.append(DeltaMessage(tool_calls=[DeltaToolCall(
                index=k, id=p.id, type="function", function=DeltaFunctionCall(name=p.name, arguments=""))]))
            k += 1
        elif isinstance(p, ToolCallArguments):  # of the call started last, in this step or before
            out.append(DeltaMessage(tool_calls=[DeltaToolCall(index=k - 1, function=DeltaFunctionCall(arguments=p.text))]))
        else:
            out.append(DeltaMessage(tool_calls=[DeltaToolCall(
                index=k, id=p.id, type="function", function=DeltaFunctionCall(name=p.name, arguments=""))]))
            out.append(DeltaMessage(tool_calls=[DeltaToolCall(index=k, function=DeltaFunctionCall(arguments=p.arguments))]))
            k += 1
    return out
