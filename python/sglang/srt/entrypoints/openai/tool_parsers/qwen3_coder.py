"""Qwen3-Coder: XML-like calls whose parameter values are raw text, a block per call:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A value is the text between its tags less one leading and one trailing newline, typed by the
tool's schema (schema_values.py); the arguments are the parameters as a JSON object, in order.

The calls stream: a call starts (its name is sent) as soon as `<function=NAME>` closes with one of
the request's tool names, and its arguments grow by a whole parameter as each closes. So the call
is committed at its name, and never goes back to content: markup that breaks off after that (the
reply cut by max_tokens, a tag missing) ends the call with the parameters that closed. A value the
reply ended inside is dropped rather than passed on cut short (a truncated file body would look
whole to the tool). Before the name is known, anything that is not this markup (an unknown name,
other text after `<tool_call>`) leaves the section as content, as with the other formats.

Lenient where Qwen3-Coder is known to slip: a value also ends at the next `<parameter=`,
`</function>` or `</tool_call>` when its `</parameter>` is missing, a call at `</tool_call>` when
its `</function>` is, and one `<tool_call>` may hold several functions. A call written without its
`<tool_call>` (`<function=NAME>` in the content, as other engines' parsers also read it) is a call
when NAME is one of the request's tools; the functions that follow it belong to its section, and a
`</tool_call>` after them closes it. Else `<function=` stays content.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Optional, Sequence

from sglang.srt.entrypoints.openai.tool_parsers.base import (
    CallArguments,
    CallEvent,
    CallStart,
    Section,
    SectionScanner,
    ToolCallFormat,
    skip_whitespace,
)
from sglang.srt.entrypoints.openai.tool_parsers.schema_values import parameter_schemas, typed_value

FUNCTION = "<function="
PARAMETER = "<parameter="
END_PARAMETER = "</parameter>"
END_FUNCTION = "</function>"
END_CALL = "</tool_call>"

AFTER_NAME = (PARAMETER, END_FUNCTION, END_CALL)  # what may follow a call's name or a parameter
VALUE_ENDS = (END_PARAMETER, PARAMETER, END_FUNCTION, END_CALL)


class _TagFinder:
    """The first of `tags` in append-only text from `start`, in time linear in the text over all
    calls. None of the tags holds another, so the first complete one found is the first there
    will be."""

    def __init__(self, tags: tuple[str, ...], start: int) -> None:
        self.tags = tags
        self.start = start
        self.pos = start  # no tag starts in text[start:pos]
        self.longest = max(len(t) for t in tags)

    def find(self, text: str) -> Optional[tuple[int, str]]:
        best: Optional[tuple[int, str]] = None
        for tag in self.tags:
            i = text.find(tag, self.pos)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, tag)
        if best is None:
            self.pos = max(self.pos, len(text) - self.longest + 1)
        return best


class _Qwen3CoderSection(SectionScanner):
    def __init__(self, names: frozenset[str], schemas: Mapping[str, Mapping[str, Any]], inline: bool = False) -> None:
        self.names = names
        self.schemas = schemas
        self.inline = inline  # opened at a bare `<function=` (the text starts with it), not after `<tool_call>`
        self.state = "function"  # "function" (before <function=), "parameters", "value"
        self.pos = 0  # where the state's text starts
        self.calls = 0  # calls started in this section
        self.events: list[CallEvent] = []
        self.function = ""  # the open call's name, its keys so far, the open parameter's name
        self.keys: list[str] = []
        self.parameter = ""
        self.finder: Optional[_TagFinder] = None
        self.name_end_from = 0  # where the open parameter's closing ">" is searched from

    def progress(self) -> list[CallEvent]:
        out, self.events = self.events, []
        return out

    def scan(self, text: str, final: bool) -> Optional[Section]:
        while True:
            if self.state == "function":
                step = self._function(text, final)
            elif self.state == "parameters":
                step = self._parameters(text, final)
            else:
                step = self._value(text, final)
            if step is not True:
                return step

    # Each state's step returns True to go on with the next state, or scan's answer.
    def _function(self, text: str, final: bool) -> Any:
        j = skip_whitespace(text, self.pos)
        rest = text[j:]
        if rest.startswith(FUNCTION):
            close = text.find(">", j + len(FUNCTION))
            name = text[j + len(FUNCTION):close if close >= 0 else len(text)].strip()
            if close < 0:
                # Still a call while the name may grow into one of the tools'.
                if not final and "\n" not in name and any(n.startswith(name) for n in self.names):
                    return None
                return self._not_a_call()
            if name not in self.names:
                return self._not_a_call()
            self.events.append(CallStart(name))
            self.calls += 1
            self.function, self.keys = name, []
            self._enter("parameters", close + 1)
            return True
        if self.calls and rest.startswith(END_CALL):
            return Section(j + len(END_CALL), [])
        if not final and (FUNCTION.startswith(rest) or (self.calls and END_CALL.startswith(rest))):
            return None  # nothing yet, or a tag's first characters
        return self._not_a_call()

    def _not_a_call(self) -> Section:
        """What follows is not a call: with calls read, the section ends after them; without, the
        section was only its marker, which stays content with all that follows (an inline section's
        marker is its text's first tag, consumed so that the content after it is scanned again)."""
        if self.calls:
            return Section(self.pos, [])
        return Section(len(FUNCTION) if self.inline else 0, None)

    def _parameters(self, text: str, final: bool) -> Any:
        found = self.finder.find(text)
        if found is None:
            return self._cut(text) if final else None
        i, tag = found
        if tag == PARAMETER:
            if self.name_end_from < i + len(PARAMETER):
                self.name_end_from = i + len(PARAMETER)
            close = text.find(">", self.name_end_from)
            if close < 0:
                self.name_end_from = len(text)
                return self._cut(text) if final else None
            self.parameter = text[i + len(PARAMETER):close].strip()
            self._enter("value", close + 1)
            return True
        self._close_call()
        if tag == END_CALL:
            return Section(i + len(END_CALL), [])
        self.state, self.pos, self.finder = "function", i + len(END_FUNCTION), None
        return True

    def _value(self, text: str, final: bool) -> Any:
        found = self.finder.find(text)
        if found is None:
            return self._cut(text) if final else None
        i, tag = found
        raw = text[self.pos:i]
        raw = raw[1:] if raw.startswith("\n") else raw
        raw = raw[:-1] if raw.endswith("\n") else raw
        self._argument(self.parameter, raw)
        # Without its </parameter>, the tag that ended the value is the next step's to read.
        self._enter("parameters", i + len(END_PARAMETER) if tag == END_PARAMETER else i)
        return True

    def _enter(self, state: str, pos: int) -> None:
        self.state, self.pos = state, pos
        self.finder = _TagFinder(VALUE_ENDS if state == "value" else AFTER_NAME, pos)

    def _argument(self, key: str, raw: str) -> None:
        if not key or key in self.keys:
            return  # a nameless parameter, or a repeat: the arguments stay one unambiguous object
        value = typed_value(raw, self.schemas.get(self.function, {}).get(key))
        piece = json.dumps(key, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)
        # json.dumps's own separators: the pieces add up to what json.dumps(arguments) writes.
        self.events.append(CallArguments(("{" if not self.keys else ", ") + piece))
        self.keys.append(key)

    def _close_call(self) -> None:
        self.events.append(CallArguments("}" if self.keys else "{}"))

    def _cut(self, text: str) -> Section:
        """The reply ended inside a call: it ends with the parameters that closed."""
        self._close_call()
        return Section(len(text), [])


class Qwen3CoderFormat(ToolCallFormat):
    name = "qwen3_coder"
    start_markers = ("<tool_call>", FUNCTION)
    inline_markers = (FUNCTION,)

    def __init__(self, tools: Optional[Sequence[Mapping[str, Any]]] = None) -> None:
        super().__init__(tools)
        self.schemas = parameter_schemas(self.tools)

    def new_section(self, names: frozenset[str]) -> SectionScanner:
        return _Qwen3CoderSection(names, self.schemas)

    def new_inline_section(self, names: frozenset[str]) -> SectionScanner:
        return _Qwen3CoderSection(names, self.schemas, inline=True)
