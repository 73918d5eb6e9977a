"""Mistral (7B-Instruct v0.3, Nemo, Small): `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`.

`[TOOL_CALLS]` is a special token of Mistral's tokenizers, so the server keeps special tokens in
the text of requests this parser reads (serving_chat). A single object instead of the array is
taken too. The calls of one array are valid together or not at all. The newer
`[TOOL_CALLS]name[ARGS]{...}` syntax (tokenizer v11+) is not read: it stays content.

Call ids are 9 letters and digits: Mistral's chat templates refuse any other id when a client
sends the calls back in the next turn's history (as vLLM's Mistral ids are).
"""

from __future__ import annotations

import secrets
import string
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


ID_ALPHABET = string.ascii_letters + string.digits


class _MistralSection(SectionScanner):
    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        self.span: Optional[JsonSpan] = None
        self.start = 0

    def scan(self, text: str, final: bool) -> Optional[Section]:
        if self.span is None:
            j = skip_whitespace(text, 0)
            if j == len(text):
                return Section(len(text), None) if final else None
            if text[j] not in "[{":
                return Section(0, None)  # not a call list: the marker alone was read
            self.span, self.start = JsonSpan(j), j
        end = self.span.end(text)
        if end is None:
            return Section(len(text), None) if final else None
        value = loads(text[self.start:end])
        items = value if isinstance(value, list) else [value]
        calls = [call_from_object(item, self.names, ("arguments",)) for item in items]
        ok = bool(calls) and all(c is not None for c in calls)
        return Section(end, calls if ok else None)  # type: ignore[arg-type]


class MistralFormat(ToolCallFormat):
    name = "mistral"
    start_markers = ("[TOOL_CALLS]",)

    def new_section(self, names: frozenset[str]) -> SectionScanner:
        return _MistralSection(names)

    def new_call_id(self) -> str:
        return "".join(secrets.choice(ID_ALPHABET) for _ in range(9))
