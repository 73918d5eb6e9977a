"""Mistral's two call syntaxes, told apart by what follows `[TOOL_CALLS]`:

* a JSON array (7B-Instruct v0.3, Nemo, Small up to tokenizer v7):
  `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`; a single object instead of the array is
  taken too. The calls of one array are valid together or not at all.
* a name (tokenizer v11+: Small 3.1/3.2, Magistral, Devstral): `[TOOL_CALLS]name[ARGS]{...}`, one
  call each, several one after another each with its own `[TOOL_CALLS]`. Models whose tokenizer
  has `[CALL_ID]` may write the call's id between the name and `[ARGS]`:
  `[TOOL_CALLS]name[CALL_ID]a1B2c3D4e[ARGS]{...}`; the id must be letters and digits, and the
  call gets this server's id like any other (Mistral's templates check the id's form only).

`[TOOL_CALLS]` (and `[ARGS]`) are special tokens of Mistral's tokenizers, so the server keeps
special tokens in the text of requests this parser reads (serving_chat). A section that is not a
call (a name outside the tools, JSON that does not parse or is cut off) stays content.

Call ids are 9 letters and digits: Mistral's chat templates refuse any other id when a client
sends the calls back in the next turn's history (as vLLM's Mistral ids are).
"""

from __future__ import annotations

import json
import secrets
import string
from typing import Optional

from sglang.srt.entrypoints.openai.tool_parsers.base import (
    JsonSpan,
    ParsedCall,
    Section,
    SectionScanner,
    ToolCallFormat,
    call_from_object,
    loads,
    skip_whitespace,
)
from sglang.srt.managers.detokenizer import longest_partial_stop


ID_ALPHABET = string.ascii_letters + string.digits
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
# A model's call id longer than this is not held back waiting for [ARGS] (Mistral's are 9 long).
MAX_MODEL_ID_CHARS = 64


class _MistralSection(SectionScanner):
    """Reads the first non-whitespace character after the marker, then hands the section to the
    syntax it opens: `[` or `{` the JSON array's, anything else the name's."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        self.syntax: Optional[SectionScanner] = None

    def scan(self, text: str, final: bool) -> Optional[Section]:
        if self.syntax is None:
            j = skip_whitespace(text, 0)
            if j == len(text):
                return Section(len(text), None) if final else None
            self.syntax = _ArraySection(self.names, j) if text[j] in "[{" else _NamedSection(self.names, j)
        return self.syntax.scan(text, final)


class _NamedSection(SectionScanner):
    """`name[ARGS]{...}` from `start`: one call."""

    def __init__(self, names: frozenset[str], start: int) -> None:
        self.names = names
        self.start = start
        self.searched = start  # ARGS is not in text[start:searched]
        self.name = ""
        self.span: Optional[JsonSpan] = None
        self.args_start = 0

    def scan(self, text: str, final: bool) -> Optional[Section]:
        if self.span is None:
            i = text.find(ARGS, max(self.start, self.searched - len(ARGS) + 1))
            if i < 0:
                self.searched = len(text)
                # Held only while the text may still become a tool's name (and a call id) and
                # [ARGS]: other text after the marker goes on as content at once.
                head = text[self.start:len(text) - longest_partial_stop(text, (ARGS, CALL_ID))].rstrip()
                if final or not self._may_become_head(head):
                    return Section(0, None)
                return None
            name, has_id, call_id = text[self.start:i].partition(CALL_ID)
            self.name = name.strip()
            if self.name not in self.names or (has_id and not _model_id(call_id.strip())):
                return Section(0, None)
            j = skip_whitespace(text, i + len(ARGS))
            if j == len(text):
                return Section(len(text), None) if final else None
            if text[j] != "{":
                return Section(0, None)
            self.span, self.args_start = JsonSpan(j), j
        end = self.span.end(text)
        if end is None:
            return Section(len(text), None) if final else None
        args = loads(text[self.args_start:end])
        if not isinstance(args, dict):
            return Section(end, None)
        return Section(end, [ParsedCall(self.name, json.dumps(args, ensure_ascii=False))])

    def _may_become_head(self, head: str) -> bool:
        """Whether `head` (the text after the marker, without a partial marker at its end) may
        still become `name` or `name[CALL_ID]id` before [ARGS]."""
        name, has_id, call_id = head.partition(CALL_ID)
        if not has_id:
            return any(n.startswith(name) for n in self.names)
        call_id = call_id.strip()
        return name.strip() in self.names and (not call_id or _model_id(call_id))


def _model_id(call_id: str) -> bool:
    """A call id as a model writes it after [CALL_ID]: letters and digits."""
    return 0 < len(call_id) <= MAX_MODEL_ID_CHARS and call_id.isascii() and call_id.isalnum()


class _ArraySection(SectionScanner):
    """`[{"name": ..., "arguments": {...}}, ...]` (or one object) from `start`."""

    def __init__(self, names: frozenset[str], start: int) -> None:
        self.names = names
        self.span = JsonSpan(start)
        self.start = start

    def scan(self, text: str, final: bool) -> Optional[Section]:
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
