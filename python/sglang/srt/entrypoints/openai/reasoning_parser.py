"""Reasoning parsers (`--reasoning-parser NAME`): a `<think>...</think>` block at the start of a
reply is the reasoning (`reasoning_content`), the rest the content.

* `qwen3`: the reply may open a block with `<think>`; a reply that does not is all content, and
  `chat_template_kwargs: {"enable_thinking": false}` (the template then closes an empty block in the
  prompt) turns the parser off for the request.
* `deepseek-r1` and `qwen3-thinking`: the template opens the block in the prompt, so the reply
  starts inside it, with or without a `<think>` of its own; without `</think>` it is all reasoning.

ReasoningStream splits as the text arrives and gives the same split whatever the chunk boundaries
(a tail that could be the start of a tag is held back). The reasoning is the block's text without
its leading and trailing whitespace; the tags and the whitespace around the block come out as
"markup", which the server drops when it separates the reasoning and keeps, verbatim, when the
request asks for `separate_reasoning: false`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sglang.srt.managers.detokenizer import longest_partial_stop

Kind = Literal["reasoning", "content", "markup"]


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    starts_in_reasoning: bool  # the prompt opened the block
    honours_enable_thinking: bool  # enable_thinking=false turns it off
    start: str = "<think>"
    end: str = "</think>"


REASONING_PARSERS: dict[str, ReasoningFormat] = {
    "qwen3": ReasoningFormat("qwen3", starts_in_reasoning=False, honours_enable_thinking=True),
    "qwen3-thinking": ReasoningFormat("qwen3-thinking", starts_in_reasoning=True, honours_enable_thinking=False),
    "deepseek-r1": ReasoningFormat("deepseek-r1", starts_in_reasoning=True, honours_enable_thinking=False),
}


class ReasoningStream:
    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt = fmt
        self.state = "start"  # start -> reasoning -> after -> content, or start -> content
        self.pending = ""
        self.held_ws = ""  # the reasoning's trailing whitespace so far
        self.lead = True  # still at the reasoning's (or the content's) leading whitespace

    @property
    def in_reasoning(self) -> bool:
        return self.state in ("start", "reasoning")

    def feed(self, text: str) -> list[tuple[Kind, str]]:
        self.pending += text
        return self._run(final=False)

    def finish(self) -> list[tuple[Kind, str]]:
        out = self._run(final=True)
        if self.held_ws:
            out.append(("markup", self.held_ws))
            self.held_ws = ""
        self.state = "content"
        return _merged(out)

    def _run(self, final: bool) -> list[tuple[Kind, str]]:
        out: list[tuple[Kind, str]] = []
        start, end = self.fmt.start, self.fmt.end
        while self.pending:
            text = self.pending
            if self.state == "start":
                rest = text.lstrip()
                lead = text[:len(text) - len(rest)]
                if rest.startswith(start):
                    out.append(("markup", lead + start))
                    self.pending, self.state = rest[len(start):], "reasoning"
                elif start.startswith(rest) and not final:
                    break  # could still become the opening tag
                else:
                    self.state = "reasoning" if self.fmt.starts_in_reasoning else "content"
            elif self.state == "reasoning":
                if self.lead:
                    rest = text.lstrip()
                    if len(rest) < len(text):
                        out.append(("markup", text[:len(text) - len(rest)]))
                        self.pending = text = rest
                    if not rest:
                        break
                    self.lead = False
                i = text.find(end)
                if i >= 0:
                    self._reasoning(out, text[:i], final=False)
                    out.append(("markup", self.held_ws + end))
                    self.held_ws = ""
                    self.pending, self.state, self.lead = text[i + len(end):], "after", True
                    continue
                keep = 0 if final else longest_partial_stop(text, [end])
                self._reasoning(out, text[:len(text) - keep], final=False)
                self.pending = text[len(text) - keep:]
                break
            elif self.state == "after":
                rest = text.lstrip()
                if len(rest) < len(text):
                    out.append(("markup", text[:len(text) - len(rest)]))
                self.pending = rest
                if rest:
                    self.state = "content"
            else:
                out.append(("content", text))
                self.pending = ""
        return _merged(out)

    def _reasoning(self, out: list[tuple[Kind, str]], text: str, final: bool) -> None:
        text = self.held_ws + text
        body = text if final else text.rstrip()
        self.held_ws = text[len(body):]
        if body:
            out.append(("reasoning", body))


def _merged(events: list[tuple[Kind, str]]) -> list[tuple[Kind, str]]:
    out: list[tuple[Kind, str]] = []
    for kind, text in events:
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))
    return out
