"""Llama 3.1 / 3.2 JSON tool calls: the reply is `{"name": ..., "parameters": {...}}` (vLLM's
llama3_json also takes "arguments"), optionally after `<|python_tag|>`, several separated by `;`.

A reply that merely starts with `{` but is not a call (a JSON answer) stays content. The calls of
one section are valid together or not at all: `{call}; {not a call}` is content whole.
"""

from __future__ import annotations

from typing import Optional

from sglang.srt.entrypoints.openai.tool_parsers.base import (
    JsonSpan,
    Section,
    SectionScanner,
    ToolCallFormat,
    call_from_object,
    loads,
    skip_whitespace,
)

ARGUMENT_KEYS = ("parameters", "arguments")


class _Llama3Section(SectionScanner):
    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        self.objects: list[tuple[int, int]] = []
        self.pos = 0  # where the next object, or the separator after the last one, is looked for
        self.after_object = False
        self.span: Optional[JsonSpan] = None
        self.span_start = 0

    def _done(self, text: str, consumed: int) -> Section:
        calls = [call_from_object(loads(text[a:b]), self.names, ARGUMENT_KEYS) for a, b in self.objects]
        ok = bool(calls) and all(c is not None for c in calls)
        return Section(consumed, calls if ok else None)  # type: ignore[arg-type]

    def scan(self, text: str, final: bool) -> Optional[Section]:
        while True:
            if self.after_object:  # a ';' and another call, or the end of the section
                j = skip_whitespace(text, self.pos)
                if j == len(text):
                    return self._done(text, self.pos) if final else None
                if text[j] != ";":
                    return self._done(text, self.pos)
                self.after_object, self.pos = False, j + 1
                continue
            if self.span is None:
                j = skip_whitespace(text, self.pos)
                if j == len(text):
                    if not final:
                        return None
                    return self._done(text, len(text)) if self.objects else Section(len(text), None)
                if text[j] != "{":
                    # Not JSON (e.g. Llama's built-in python tools after <|python_tag|>): the
                    # section ends after the objects read; with none, only the marker was read.
                    return self._done(text, self.pos) if self.objects else Section(0, None)
                self.span, self.span_start = JsonSpan(j), j
            end = self.span.end(text)
            if end is None:
                return Section(len(text), None) if final else None
            self.objects.append((self.span_start, end))
            self.span, self.pos, self.after_object = None, end, True


class Llama3Format(ToolCallFormat):
    name = "llama3"
    start_markers = ("<|python_tag|>",)

    def opens_at_start(self, text: str) -> bool:
        return text.startswith("{")

    def new_section(self, names: frozenset[str]) -> SectionScanner:
        return _Llama3Section(names)
