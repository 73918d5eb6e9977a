"""`strict: true` tools under tool_choice "auto": the structural tag that keeps their calls to their
schemas while the rest of the reply stays free.

Under "auto" the model may answer in text, call, or both, so the whole reply cannot be one JSON
schema (as under "required"). A structural tag (xgrammar's, GrammarSpec kind "structural_tag") is
free text until a trigger string, then a tag whose content is a grammar, then free text again. The
trigger is the `--tool-call-parser`'s start marker, so every call the parser reads has gone through
the grammar: a call to a strict tool is `{"name": <it>, "arguments": <its parameters schema>}` in
the parser's syntax; a call to a tool without `strict` is any JSON object of arguments; and once the
marker is written the call must be to one of the request's tools (the parser would not read any
other as a call). The tags are written the way the parsers' models write them (Qwen's
`<tool_call>\\n{"name": ...}\\n</tool_call>`), one spelling each: the constraint steers the model to
it, and the parser reads it as it reads any other.

Per parser:
* hermes (qwen25, qwen): trigger `<tool_call>`; a JSON string in the arguments cannot hold
  `</tool_call>` (the parser would end the call there).
* qwen3_coder: trigger `<tool_call>`, then `<function=NAME>` and the parameters as XML
  (xgrammar's `qwen_xml` style: each value raw text typed by its schema, as the parser types it);
  also trigger `<function=`, the same call without its `<tool_call>` block, which the parser reads too.
* mistral: trigger `[TOOL_CALLS]`, then either syntax the parser reads: a JSON array of
  `{"name", "arguments"}` or (tokenizer v11+) `NAME[ARGS]{...}`.
* llama3: not expressible, refused (NOT_EXPRESSIBLE says why).

With a reasoning parser, the reasoning block is free text (a call written while thinking is
reasoning, not a call, for the parser too); the grammar switches on after it. With
parallel_tool_calls false, the reply ends after its first call (the parser keeps only that one).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from sglang.srt.entrypoints.openai.reasoning_parser import ReasoningFormat

Format = dict[str, Any]  # a node of xgrammar's structural-tag format tree, as JSON
# The arguments of a call to a tool without `strict`: any JSON object.
ANY_OBJECT: dict[str, Any] = {"type": "object"}

# Parsers (their format's name) whose calls a structural tag cannot hold to their schemas.
NOT_EXPRESSIBLE = {
    "llama3": "llama3's calls have no marker of their own (a reply that opens with a JSON object is read "
              "as calls, with any spacing and either \"parameters\" or \"arguments\"), and a structural tag "
              "switches on only at a literal trigger string, so a call could escape the constraint",
}


@dataclass(frozen=True)
class ToolGrammar:
    """One tool as the grammar holds its calls: `arguments`, the JSON schema of its arguments (its
    `parameters` if strict, else ANY_OBJECT)."""

    name: str
    arguments: dict[str, Any]


def _const(text: str) -> Format:
    return {"type": "const_string", "value": text}


def _json(schema: dict[str, Any], excludes: tuple[str, ...] = (), style: str = "json") -> Format:
    node: Format = {"type": "json_schema", "json_schema": schema}
    if style != "json":
        node["style"] = style
    if excludes:
        node["excludes"] = list(excludes)
    return node


def _tag(begin: str, content: Format, end: str) -> Format:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def _triggered(triggers: list[str], tags: list[Format], parallel: bool) -> Format:
    # stop_after_first: the first call ends the reply (parallel_tool_calls false).
    return {"type": "triggered_tags", "triggers": triggers, "tags": tags, "stop_after_first": not parallel}


def _hermes(tools: list[ToolGrammar], parallel: bool) -> Format:
    tags = [_tag('<tool_call>\n{"name": ' + json.dumps(t.name, ensure_ascii=False) + ', "arguments": ',
                 _json(t.arguments, excludes=("</tool_call>",)), "}\n</tool_call>") for t in tools]
    return _triggered(["<tool_call>"], tags, parallel)


def _qwen3_coder(tools: list[ToolGrammar], parallel: bool) -> Format:
    # What would end a value early for the parser cannot be inside one.
    ends = ("<parameter=", "</function>", "</tool_call>")
    params = [_json(t.arguments, excludes=ends, style="qwen_xml") for t in tools]
    tags = [_tag(f"<tool_call>\n<function={t.name}>\n", p, "</function>\n</tool_call>") for t, p in zip(tools, params)]
    # The parser also reads a call written without its <tool_call> (its inline marker): held the same.
    tags += [_tag(f"<function={t.name}>\n", p, "</function>") for t, p in zip(tools, params)]
    return _triggered(["<tool_call>", "<function="], tags, parallel)


def _mistral(tools: list[ToolGrammar], parallel: bool) -> Format:
    items = [_tag('{"name": ' + json.dumps(t.name, ensure_ascii=False) + ', "arguments": ', _json(t.arguments), "}")
             for t in tools]
    array: Format = {"type": "tags_with_separator", "tags": items, "separator": ", ", "at_least_one": True,
                     "stop_after_first": not parallel}
    # The array as the older models write it (a space after the marker, as their tokenizer puts it),
    # or without the space; then the v11+ syntax, a tag per tool.
    tags = [_tag(begin, array, "]") for begin in ("[TOOL_CALLS] [", "[TOOL_CALLS][")]
    tags += [_tag(f"[TOOL_CALLS]{t.name}[ARGS]", _json(t.arguments), "") for t in tools]
    return _triggered(["[TOOL_CALLS]"], tags, parallel)


BUILDERS = {"hermes": _hermes, "qwen3_coder": _qwen3_coder, "mistral": _mistral}


def unreadable_name(parser: str, name: str) -> Optional[str]:
    """Why the tool-call format `parser` could not read back a call to a tool named `name` as its
    tag spells it (the grammar would make the model write a call that comes out as content), or
    None. Names are otherwise free: OpenAI's own are letters, digits, "_" and "-"."""
    if parser == "hermes" and "</tool_call>" in name:
        return "the parser ends a call at the first </tool_call>"
    if parser == "qwen3_coder" and (">" in name or "\n" in name or name != name.strip()):
        return ("the parser reads a name up to the first \">\" on its line, without the white space at its "
                "ends")
    if parser == "mistral" and ("[ARGS]" in name or "[CALL_ID]" in name or name != name.strip()
                                or name[:1] in ("[", "{")):
        return ("the parser reads [TOOL_CALLS]NAME[ARGS] up to the first [ARGS] (or [CALL_ID]), without the "
                "white space at the name's ends, and a name opening with \"[\" or \"{\" as the JSON array of calls")
    return None


def _after_reasoning(body: Format, reasoning: ReasoningFormat) -> Format:
    """`body` after the reasoning block, which is free text, as the reasoning parser reads it: a
    block closed by its end tag, or one that never closes (all reasoning); one the template opened
    in the prompt has no start tag of its own, and a reply that opens none is `body` alone."""
    thinking = {"type": "any_text"}
    unclosed = {"type": "any_text", "excludes": [reasoning.end]}
    if reasoning.starts_in_reasoning:
        return {"type": "or", "elements": [
            {"type": "sequence", "elements": [_tag("", thinking, reasoning.end), body]}, unclosed]}
    return {"type": "or", "elements": [
        {"type": "sequence", "elements": [_tag(reasoning.start, thinking, reasoning.end), body]},
        body,
        {"type": "sequence", "elements": [_const(reasoning.start), unclosed]}]}


def strict_tools_tag(parser: str, tools: list[ToolGrammar], parallel_tool_calls: bool = True,
                     reasoning: Optional[ReasoningFormat] = None) -> dict[str, Any]:
    """The structural tag (xgrammar's JSON form) of a reply under tool_choice "auto" whose calls, in
    the syntax of the tool-call format `parser` (a ToolCallFormat's name), are held to `tools`.
    ValueError (naming why) for a format that cannot be expressed."""
    if parser in NOT_EXPRESSIBLE:
        raise ValueError(NOT_EXPRESSIBLE[parser])
    build = BUILDERS.get(parser)
    if build is None:
        raise ValueError(f"the {parser} tool-call format has no structural tag")
    body = build(tools, parallel_tool_calls)
    if reasoning is not None:
        body = _after_reasoning(body, reasoning)
    return {"type": "structural_tag", "format": body}
