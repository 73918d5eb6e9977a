"""ToolCallStream: one reply's text in, its content and tool calls out, as the text arrives.

The same object parses a whole reply (one `feed`, then `finish`) and a stream (a `feed` per chunk),
so a streamed reply always adds up to the non-streamed one, whatever the chunk boundaries:

* text is emitted as soon as it cannot be the start of a call: a tail that could still become a
  start marker (`<tool_ca`) is held back until the next chunk decides;
* a call section is held whole until the format says it is complete, then becomes calls, or, when
  it is not a valid call, goes back to the content verbatim (marker included); a format that
  streams its calls (see base.py) gives each call's name and argument pieces as they become
  certain instead, and such a call never goes back to content;
* whitespace next to a call is dropped: whitespace is held back until what follows it is known,
  and dropped if that is a call or (after a call) the end of the reply. So `Let me check.\n<call>`
  gives the content `Let me check.`, calls separated by newlines give none, and text after a call
  keeps its own line break. A reply without calls is passed through unchanged.
"""

from __future__ import annotations

from typing import Optional, Union

from sglang.srt.entrypoints.openai.tool_parsers.base import (
    CallArguments,
    CallEvent,
    CallStart,
    ParsedCall,
    SectionScanner,
    ToolCallFormat,
)
from sglang.srt.managers.detokenizer import longest_partial_stop

Event = Union[str, ParsedCall, CallStart, CallArguments]  # content text, a whole call, or a streamed call's part


class ToolCallStream:
    def __init__(self, fmt: ToolCallFormat, names: frozenset[str], max_calls: Optional[int] = None) -> None:
        """`max_calls`: calls past this many are dropped (`parallel_tool_calls: false`)."""
        self.fmt = fmt
        self.names = names
        self.max_calls = max_calls
        self.pending = ""  # text not yet emitted or scanned
        self.held_ws = ""  # whitespace not yet emitted, waiting to know what follows it
        self.started = False  # a non-whitespace character has been seen
        self.after_call = False  # no content since the last call (held whitespace ends with it)
        self.section: Optional[SectionScanner] = None
        self.marker = ""  # the start marker of the open section ("" for a bare one)
        self.section_text = ""
        self.num_calls = 0  # calls emitted
        self.dropping = False  # the streamed call now open is past max_calls: its parts are dropped
        self.finished = False

    def feed(self, text: str) -> list[Event]:
        assert not self.finished, "feed after finish"
        self.pending += text
        return self._run(final=False)

    def finish(self) -> list[Event]:
        """The reply ended: the held text and any open section are settled."""
        assert not self.finished, "finish twice"
        out = self._run(final=True)
        self.finished = True
        if self.held_ws and not self.after_call:
            out.append(self.held_ws)
        self.held_ws = ""
        return _merged(out)

    # ------------------------------------------------------------------ internals
    def _run(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            if self.section is not None:
                self.section_text += self.pending
                self.pending = ""
                found = self.section.scan(self.section_text, final)
                self._streamed(out, self.section.progress())
                if found is None:
                    return _merged(out)
                rest = self.section_text[found.consumed:]
                if found.calls is None:
                    # An inline section gives its text back from the marker on: consuming nothing
                    # would open it again at the same marker, forever.
                    assert self.marker or found.consumed > 0, "an inline section must consume its marker"
                    self._text(out, self.marker + self.section_text[:found.consumed])
                else:
                    self.held_ws = ""  # it only separated the text before from the calls
                    for call in found.calls:
                        if self.max_calls is None or self.num_calls < self.max_calls:
                            out.append(call)
                            self.num_calls += 1
                    self.after_call = True
                self.section, self.marker, self.section_text = None, "", ""
                self.pending = rest
                continue
            text = self.pending
            if not self.started:
                stripped = text.lstrip()
                if not stripped:
                    if final:
                        self._text(out, text)
                        self.pending = ""
                    return _merged(out)  # only whitespace so far: a bare call may still follow
                self.started = True
                if self.fmt.opens_at_start(stripped):
                    self._text(out, text[:len(text) - len(stripped)])
                    self._open("", stripped)
                    continue
            at, marker = _first_marker(text, self.fmt.start_markers)
            if marker:
                self._text(out, text[:at])
                if marker in self.fmt.inline_markers:  # a call's own first tag: the section's text starts with it
                    self._open("", text[at:], inline=True)
                else:
                    self._open(marker, text[at + len(marker):])
                continue
            keep = 0 if final else longest_partial_stop(text, self.fmt.start_markers)
            self._text(out, text[:len(text) - keep])
            self.pending = text[len(text) - keep:]
            return _merged(out)

    def _streamed(self, out: list[Event], events: list[CallEvent]) -> None:
        """A streaming format's call parts, counted against max_calls as whole calls are."""
        for e in events:
            if isinstance(e, CallArguments):
                if not self.dropping:
                    out.append(e)
                continue
            self.held_ws = ""  # it only separated the text before from the call
            self.after_call = True
            self.dropping = self.max_calls is not None and self.num_calls >= self.max_calls
            if not self.dropping:
                out.append(e)
                self.num_calls += 1

    def _open(self, marker: str, rest: str, inline: bool = False) -> None:
        self.section = self.fmt.new_inline_section(self.names) if inline else self.fmt.new_section(self.names)
        self.marker, self.section_text, self.pending = marker, "", rest

    def _text(self, out: list[Event], text: str) -> None:
        """Emit content text, holding back its trailing whitespace (see the module docstring)."""
        text = self.held_ws + text
        body = text.rstrip()
        self.held_ws = text[len(body):]
        if body:
            out.append(body)
            self.after_call = False


def _first_marker(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    best, found = len(text), ""
    for m in markers:
        i = text.find(m)
        if 0 <= i < best:
            best, found = i, m
    return best, found


def _merged(events: list[Event]) -> list[Event]:
    out: list[Event] = []
    for e in events:
        if isinstance(e, str) and out and isinstance(out[-1], str):
            out[-1] += e
        else:
            out.append(e)
    return out
