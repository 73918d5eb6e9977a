"""What every tool-call format shares: the parsed call, the section a format scans after its start
marker, and the JSON helpers the formats use.

A format only says where a call section starts (`start_markers`, or `opens_at_start` for a bare
JSON reply) and what a section holds (`new_section().scan`); `stream.ToolCallStream` does the rest
(text around the calls, chunk boundaries, whitespace) the same way for every format.

Most formats give a section's calls whole once it is complete (a JSON call is only known to be one
when its JSON parses). A format whose calls are committed by their name alone (Qwen3-Coder's XML)
may stream them instead: its scanner's `progress()` gives a CallStart, then CallArguments pieces.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Optional, Sequence, Union


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object, serialised (OpenAI's `function.arguments`)


@dataclass(frozen=True)
class CallStart:
    """A streamed call's name: the call is certain from here on, its arguments follow."""

    name: str


@dataclass(frozen=True)
class CallArguments:
    """More of the arguments of the call started last; its pieces add up to a JSON object."""

    text: str


CallEvent = Union[ParsedCall, CallStart, CallArguments]


@dataclass(frozen=True)
class Section:
    """A scanned call section: its first `consumed` characters (after the marker) are the section;
    `calls` are the calls they hold, or None when they are not valid calls (a name outside the
    request's tools, JSON that does not parse): then the section's text stays content, marker and
    all, as vLLM leaves it."""

    consumed: int
    calls: Optional[list[ParsedCall]]


class SectionScanner:
    """Scans one call section as its text grows. `scan(text, final)` gets the section's whole text
    so far (append-only) each time and returns None while the section may still go on, or the
    Section once it is complete; with `final` (the output ended) it always returns a Section. An
    implementation keeps its progress so that a long section costs linear time."""

    def scan(self, text: str, final: bool) -> Optional[Section]:
        raise NotImplementedError

    def progress(self) -> list[CallEvent]:
        """The streamed calls' parts that the last `scan` made certain (read after every scan).
        Once a scanner has given a CallStart the section cannot go back to content: it must close
        the call's arguments and end in a Section whose `calls` are not None. Default: nothing,
        the section's calls come whole in its Section."""
        return []


class ToolCallFormat:
    """A model family's tool-call syntax. `names`: the request's tool names (a call to any other
    name is not a call). `tools`: the request's tool definitions (OpenAI's shape, checked), for a
    format whose arguments are untyped text that their JSON schemas type; the others ignore them.
    One instance serves one request."""

    name: ClassVar[str]
    start_markers: ClassVar[tuple[str, ...]] = ()
    # Of start_markers, those that are a call's own first tag rather than a wrapper around calls
    # (Qwen3-Coder's `<function=` written without its `<tool_call>`): the section opens at such a
    # marker, and the scanner of `new_inline_section` reads it as the start of its text.
    inline_markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tools: Optional[Sequence[Mapping[str, Any]]] = None) -> None:
        self.tools: tuple[Mapping[str, Any], ...] = tuple(tools or ())

    def opens_at_start(self, text: str) -> bool:
        """Whether a section starts at the very beginning of the content without a marker;
        `text` is the content so far, past its leading whitespace (at least one character)."""
        return False

    def new_section(self, names: frozenset[str]) -> SectionScanner:
        raise NotImplementedError

    def new_inline_section(self, names: frozenset[str]) -> SectionScanner:
        """The scanner of a section opened by one of `inline_markers`. Its text starts with the
        marker; when it holds no call it must consume at least the marker (which stays content)."""
        raise NotImplementedError

    def new_call_id(self) -> str:
        """The id of a call in the reply."""
        return new_call_id()


def new_call_id() -> str:
    """A fresh id for a call in a reply (`call_` and 24 hex digits, as OpenAI's look)."""
    return f"call_{uuid.uuid4().hex[:24]}"


# ---------------------------------------------------------------------------- JSON helpers
class JsonSpan:
    """Where the JSON object or array that opens at `start` closes, over append-only text, in time
    linear in the text: brackets are counted outside strings. Whether the span is valid JSON is
    json.loads's to say."""

    def __init__(self, start: int) -> None:
        self.pos = start
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def end(self, text: str) -> Optional[int]:
        """The index just past the closing bracket, or None if it has not come yet."""
        for i in range(self.pos, len(text)):
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    self.pos = i + 1
                    return i + 1
        self.pos = len(text)
        return None


def skip_whitespace(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def strict_json(text: str) -> Any:
    """json.loads, refusing (ValueError) NaN and the infinities (`NaN`, `Infinity`, `1e999`) at any
    depth: Python's json reads them, and json.dumps would write them back into a call's arguments,
    which would then not be JSON for the client. RecursionError past Python's nesting limit."""
    return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)


def loads(text: str) -> Any:
    """strict_json, or None for text that is not JSON (or nested past Python's recursion limit)."""
    try:
        return strict_json(text)
    except (ValueError, RecursionError):
        return None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is not a finite number")
    return value


def call_from_object(obj: Any, names: frozenset[str], argument_keys: tuple[str, ...]) -> Optional[ParsedCall]:
    """The call a decoded `{"name": ..., "<argument key>": {...}}` stands for, or None. Arguments
    may be an object or a string holding one (some fine-tunes quote them); none means `{}`."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or name not in names:
        return None
    args: Any = next((obj[k] for k in argument_keys if k in obj), {})
    if isinstance(args, str):
        args = loads(args)
    if not isinstance(args, dict):
        return None
    return ParsedCall(name=name, arguments=json.dumps(args, ensure_ascii=False))
