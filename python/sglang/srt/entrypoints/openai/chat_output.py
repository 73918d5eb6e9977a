"""A chat reply's text split into reasoning, content and tool calls, whole or as it streams.

`OutputSpec` is what one request asks for (built by chat_tools.output_spec); `spec.parser()` gives
one choice's `ChatOutputParser`. Text goes through the reasoning parser first; tool calls are read
from the content after the reasoning only. `feed` returns the parts that became final, in order;
a non-streamed reply is one `feed` and `finish`, so it is what the streamed parts add up to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from sglang.srt.entrypoints.openai.protocol import ChatResponseMessage, DeltaMessage
from sglang.srt.entrypoints.openai.protocol_tools import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from sglang.srt.entrypoints.openai.reasoning_parser import ReasoningFormat, ReasoningStream
from sglang.srt.entrypoints.openai.tool_parsers import ParsedCall, ToolCallFormat, ToolCallStream


@dataclass(frozen=True)
class ToolCallPart:
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class TextPart:
    kind: str  # "reasoning" or "content"
    text: str


Part = Union[TextPart, ToolCallPart]


@dataclass(frozen=True)
class OutputSpec:
    reasoning: Optional[ReasoningFormat] = None
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    tool_format: Optional[ToolCallFormat] = None
    tool_names: frozenset[str] = frozenset()
    parallel_tool_calls: bool = True

    @property
    def plain(self) -> bool:
        """Nothing to parse: the text is the content."""
        return self.reasoning is None and self.tool_format is None

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
        self.num_tool_calls = 0
        self._held_reasoning = ""  # stream_reasoning false: the reasoning until it ends

    def feed(self, text: str) -> list[Part]:
        return self._route(self.reasoning.feed(text) if self.reasoning else [("content", text)], final=False)

    def finish(self) -> list[Part]:
        return self._route(self.reasoning.finish() if self.reasoning else [], final=True)

    def parse(self, text: str) -> ParsedReply:
        """A whole reply (this parser must be fresh)."""
        parts = self.feed(text) + self.finish()
        content = "".join(p.text for p in parts if isinstance(p, TextPart) and p.kind == "content")
        reasoning = "".join(p.text for p in parts if isinstance(p, TextPart) and p.kind == "reasoning")
        calls = [p for p in parts if isinstance(p, ToolCallPart)]
        return ParsedReply(content=content if content or not calls else None,
                           reasoning_content=reasoning or None, tool_calls=calls)

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

    def _content(self, events: list[Union[str, ParsedCall]]) -> list[Part]:
        out: list[Part] = []
        for e in events:
            if isinstance(e, str):
                out.append(TextPart("content", e))
            else:
                out.append(ToolCallPart(self.spec.tool_format.new_call_id(), e.name, e.arguments))
                self.num_tool_calls += 1
        return out


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
    """One delta per text part; two per call (its id, type and name, then its arguments), the
    calls numbered from `first_call_index` (the calls the choice streamed before)."""
    out: list[DeltaMessage] = []
    k = first_call_index
    for p in parts:
        if isinstance(p, TextPart):
            out.append(DeltaMessage(reasoning_content=p.text) if p.kind == "reasoning" else DeltaMessage(content=p.text))
        else:
            out.append(DeltaMessage(tool_calls=[DeltaToolCall(
                index=k, id=p.id, type="function", function=DeltaFunctionCall(name=p.name, arguments=""))]))
            out.append(DeltaMessage(tool_calls=[DeltaToolCall(index=k, function=DeltaFunctionCall(arguments=p.arguments))]))
            k += 1
    return out
