"""Hermes / Qwen2.5 / Qwen3: each call is `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
several calls one after another; text may come before them (and, rarely, between or after)."""

from __future__ import annotations

from typing import Optional

from sglang.srt.entrypoints.openai.tool_parsers.base import (
    Section,
    SectionScanner,
    ToolCallFormat,
    call_from_object,
    loads,
)

END = "</tool_call>"


class _HermesSection(SectionScanner):
    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        self.searched = 0  # END is not in text[:searched]

    def scan(self, text: str, final: bool) -> Optional[Section]:
        i = text.find(END, max(0, self.searched - len(END) + 1))
        if i < 0:
            self.searched = len(text)
            if not final:
                return None
            body, consumed = text, len(text)  # the output ended inside the call: take what is there
        else:
            body, consumed = text[:i], i + len(END)
        call = call_from_object(loads(body), self.names, ("arguments",))
        return Section(consumed, [call] if call is not None else None)


class HermesFormat(ToolCallFormat):
    name = "hermes"
    start_markers = ("<tool_call>",)

    def new_section(self, names: frozenset[str]) -> SectionScanner:
        return _HermesSection(names)
