"""What a constrained request asks its output to match: one regular expression, JSON schema, EBNF
grammar or structural tag (SGLang's `regex`, `json_schema`, `ebnf`, `structural_tag` sampling
parameters). Plain data: the tokenizer manager validates it, the scheduler compiles it
(sglang/srt/constrained/), the cache keys on it.

A structural tag is xgrammar's JSON form (`{"type": "structural_tag", "format": {...}}`): free text
that switches to a grammar at a trigger string, which is how tool_choice "auto" keeps `strict`
tools' calls to their schemas (entrypoints/openai/strict_tools.py). SGLang's and vLLM's older form,
`{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`, is read too: it is the
`triggered_tags` format of xgrammar's (`legacy_structural_tag`)."""

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
    as an object (it is serialised, keys in their order); anything else must be a string (ValueError).
    A structural tag in the older `structures` / `triggers` form becomes xgrammar's."""
    if value is None:
        return None
    if kind == "structural_tag":
        value = legacy_structural_tag(value, kind)
    if kind in JSON_KINDS and isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    if not isinstance(value, str):
        expected = "a JSON string or an object" if kind in JSON_KINDS else "a string"
        raise ValueError(f"{kind} must be {expected}, got {type(value).__name__}")
    return value


def legacy_structural_tag(value: Any, what: str) -> Any:
    """`value` (an object or its JSON text) in xgrammar's form where it is in the older one
    (`structures` of `{"begin", "schema", "end"}` and `triggers`: free text in which a trigger starts
    the structure whose `begin` it prefixes, whose `schema` holds the JSON between `begin` and
    `end`; any JSON value without one), else unchanged: anything else is the grammar compiler's to judge (its errors name what
    is wrong). ValueError, naming `what`, for an older form with fields of the wrong kind."""
    tag = value
    if isinstance(value, str):
        try:
            tag = json.loads(value)
        except ValueError:
            return value
    if not isinstance(tag, dict) or "structures" not in tag:
        return value
    unknown = sorted(set(tag) - {"type", "structures", "triggers"})
    if unknown or tag.get("type", "structural_tag") != "structural_tag":
        raise ValueError(f"{what}: the structures form takes only type 'structural_tag', structures and triggers"
                         + (f", got {unknown}" if unknown else ""))
    structures, triggers = tag["structures"], tag.get("triggers")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError(f"{what}.triggers must be a non-empty list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise ValueError(f"{what}.structures must be a non-empty list of {{begin, schema, end}} objects")
    tags = []
    for i, item in enumerate(structures):
        where = f"{what}.structures[{i}]"
        if not isinstance(item, dict) or not {"begin", "end"} <= set(item) <= {"begin", "schema", "end"}:
            raise ValueError(f"{where} must be an object of begin, end and (optionally) schema")
        if not isinstance(item["begin"], str) or not isinstance(item["end"], str) or not item["begin"]:
            raise ValueError(f"{where}: begin (non-empty) and end must be strings")
        schema = item.get("schema", {})  # none given: any JSON value, as SGLang reads it
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                raise ValueError(f"{where}.schema is not valid JSON") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"{where}.schema must be a JSON schema (an object or its JSON text)")
        tags.append({"type": "tag", "begin": item["begin"], "content": {"type": "json_schema", "json_schema": schema},
                     "end": item["end"]})
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}}


def choice_grammar(choices: Any, what: str = "guided_choice") -> str:
    """An EBNF grammar whose language is exactly `choices` (vLLM's guided_choice): string literals
    escaped as JSON escapes them, which the EBNF grammar's literals read the same way."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError(f"{what} must be a non-empty list of strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
