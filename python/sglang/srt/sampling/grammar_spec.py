"""What a constrained request asks its output to match: one regular expression, JSON schema, EBNF
grammar or structural tag (SGLang's `regex`, `json_schema`, `ebnf`, `structural_tag` sampling
parameters). Plain data: the tokenizer manager validates it, the scheduler compiles it
(sglang/srt/constrained/), the cache keys on it.

A structural tag is xgrammar's JSON form (`{"type": "structural_tag", "format": {...}}`): free text
that switches to a grammar at a trigger string, which is how tool_choice "auto" keeps `strict`
tools' calls to their schemas (entrypoints/openai/strict_tools.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

# The sampling parameters that carry a constraint, in the order they are named in messages.
GRAMMAR_KINDS = ("regex", "json_schema", "ebnf", "structural_tag")
# How messages call each kind.
KIND_NAMES = {"regex": "regex", "json_schema": "JSON schema", "ebnf": "EBNF grammar",
              "structural_tag": "structural tag"}
# The kinds whose value is JSON: an object is taken too, and serialised.
JSON_KINDS = ("json_schema", "structural_tag")
# The grammar of `{"type": "json_object"}` (OpenAI) and vLLM's `json_object`: any JSON object.
ANY_JSON_OBJECT = '{"type": "object"}'


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # one of GRAMMAR_KINDS
    value: str  # the regex, the schema or structural tag as JSON text, or the EBNF grammar (root rule `root`)

    def __post_init__(self) -> None:
        assert self.kind in GRAMMAR_KINDS, self.kind


def normalize_constraint(kind: str, value: Any) -> Optional[str]:
    """A constraint parameter as text: None stays None; a JSON schema or structural tag may be given
    as an object (it is serialised, keys in their order); anything else must be a string (ValueError)."""
    if value is None:
        return None
    if kind in JSON_KINDS and isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    if not isinstance(value, str):
        expected = "a JSON string or an object" if kind in JSON_KINDS else "a string"
        raise ValueError(f"{kind} must be {expected}, got {type(value).__name__}")
    return value


def choice_grammar(choices: Any, what: str = "guided_choice") -> str:
    """An EBNF grammar whose language is exactly `choices` (vLLM's guided_choice): string literals
    escaped as JSON escapes them, which the EBNF grammar's literals read the same way."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError(f"{what} must be a non-empty list of strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
