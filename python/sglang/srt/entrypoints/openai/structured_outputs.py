"""The OpenAI routes' structured-output fields, read as the native constraint they ask for.

Accepted (at most one per request), as OpenAI, SGLang and vLLM spell them:
  * `response_format`: `{"type": "text"}` (nothing), `{"type": "json_object"}` (any JSON object),
    `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`, `{"type":
    "structural_tag", ...}` (xgrammar's `format`, or SGLang's and vLLM's `structures` and `triggers`:
    grammar_spec.legacy_structural_tag);
  * SGLang's extra fields `regex`, `json_schema` (JSON text or an object), `ebnf`, `structural_tag`;
  * vLLM's `guided_json`, `guided_regex`, `guided_choice` (a list of strings), `guided_grammar`
    (EBNF), and `structured_outputs` `{"json" | "regex" | "choice" | "grammar" | "json_object" |
    "structural_tag"}`.
Refused with a message: two of them at once, one of them beside a chat request's tool_choice
"required" or named function (which constrains the output to the calls: chat_tools.py) or beside
`strict` tools under tool_choice "auto" (which constrain the calls: strict_tools.py),
`guided_whitespace_pattern` and `structured_outputs.whitespace_pattern`, and a
`guided_decoding_backend` other than the one this server runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from sglang.srt.constrained.backends import how_to_enable
from sglang.srt.managers.generate_request import InvalidRequestError
from sglang.srt.sampling.grammar_spec import (
    ANY_JSON_OBJECT,
    GrammarSpec,
    choice_grammar,
    legacy_structural_tag,
    normalize_constraint,
)

# vLLM's guided_decoding_backend values that mean "whatever the server runs".
AUTO_BACKENDS = ("auto",)
# structured_outputs' options that ask for nothing when left at these values.
NEUTRAL_STRUCTURED_OPTIONS = {"disable_fallback": (False, True), "disable_any_whitespace": (False,),
                              "disable_additional_properties": (False,), "whitespace_pattern": (None,)}
# structured_outputs' constraints (one at most) and the native kind each one is.
STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "choice": "ebnf", "grammar": "ebnf",
                    "json_object": "json_schema", "structural_tag": "structural_tag"}


@dataclass(frozen=True)
class Constraint:
    spec: GrammarSpec  # the native sampling parameter (`spec.kind`) and its value
    field: str  # the request field that asked for it: errors name it
    # The tools' constraints (chat_tools.py) only: how messages call it, where not by its field;
    # what it holds the output to; the request field whose option needs constrained decoding.
    what: str = ""
    holds: str = "to the calls' JSON"
    asked_by: str = "tool_choice"
    # Specs inside `spec`, checked first each under its own field, so that a bad one is named there.
    parts: tuple[tuple[GrammarSpec, str], ...] = ()


def _text(kind: str, value: Any, field: str) -> str:
    if kind == "structural_tag":
        try:  # the older form's own messages, naming the field
            value = legacy_structural_tag(value, field)
        except ValueError as e:
            raise InvalidRequestError(str(e), param=field) from None
    try:
        text = normalize_constraint(kind, value)
    except ValueError:
        expected = "a JSON schema (an object or its JSON text)" if kind == "json_schema" else "a string"
        raise InvalidRequestError(f"{field} must be {expected}, got {type(value).__name__}", param=field) from None
    assert text is not None
    return text


def _choice(value: Any, field: str) -> str:
    try:
        return choice_grammar(value, field)
    except ValueError as e:
        raise InvalidRequestError(str(e), param=field) from None


def _response_format(value: Any) -> Optional[GrammarSpec]:
    field = "response_format"
    if not isinstance(value, dict):
        raise InvalidRequestError("response_format must be an object", param=field)
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_schema", ANY_JSON_OBJECT)
    if kind == "json_schema":
        js = value.get("json_schema")
        if not isinstance(js, dict):
            raise InvalidRequestError(
                "response_format.json_schema must be an object ({'name', 'schema', 'strict'})", param=field)
        schema = js.get("schema")
        if not isinstance(schema, dict):
            raise InvalidRequestError("response_format.json_schema.schema must be an object (a JSON schema)",
                                      param=field)
        if js.get("name") is not None and not isinstance(js["name"], str):
            raise InvalidRequestError("response_format.json_schema.name must be a string", param=field)
        if js.get("strict") is not None and not isinstance(js["strict"], bool):
            raise InvalidRequestError("response_format.json_schema.strict must be a boolean", param=field)
        return GrammarSpec("json_schema", _text("json_schema", schema, field))
    if kind == "structural_tag":  # the object itself is the tag, in either form
        return GrammarSpec("structural_tag", _text("structural_tag", value, field))
    raise InvalidRequestError("response_format type must be 'text', 'json_object', 'json_schema' or "
                              f"'structural_tag', got {kind!r}", param=field)


def _structured_outputs(value: Any) -> Optional[GrammarSpec]:
    field = "structured_outputs"
    if not isinstance(value, dict):
        raise InvalidRequestError("structured_outputs must be an object", param=field)
    for key, neutral in NEUTRAL_STRUCTURED_OPTIONS.items():
        if key in value and not any(value[key] == v and type(value[key]) is type(v) for v in neutral):
            raise InvalidRequestError(f"structured_outputs.{key} is not supported", param=field)
    unknown = sorted(set(value) - {*STRUCTURED_KINDS, *NEUTRAL_STRUCTURED_OPTIONS})
    if unknown:
        raise InvalidRequestError(f"structured_outputs: unknown option(s) {unknown}", param=field)
    given = [k for k in STRUCTURED_KINDS if value.get(k) not in (None, False)]
    if len(given) > 1:
        raise InvalidRequestError(f"structured_outputs takes one of {', '.join(STRUCTURED_KINDS)}, "
                                  f"got {' and '.join(given)}", param=field)
    if not given:
        return None
    key = given[0]
    sub = f"{field}.{key}"
    if key == "json":
        return GrammarSpec("json_schema", _text("json_schema", value[key], sub))
    if key == "regex":
        return GrammarSpec("regex", _text("regex", value[key], sub))
    if key == "choice":
        return GrammarSpec("ebnf", _choice(value[key], sub))
    if key in ("grammar", "structural_tag"):
        return GrammarSpec(STRUCTURED_KINDS[key], _text(STRUCTURED_KINDS[key], value[key], sub))
    if value[key] is not True:
        raise InvalidRequestError("structured_outputs.json_object must be a boolean", param=field)
    return GrammarSpec("json_schema", ANY_JSON_OBJECT)


def requested_constraint(request: Any, backend: str) -> Optional[Constraint]:
    """The constraint a completions or chat request asks for (None: none); InvalidRequestError
    for a malformed or unsupported one. `backend`: the server's --grammar-backend."""
    extra = getattr(request, "model_extra", None) or {}
    if extra.get("guided_whitespace_pattern") is not None:
        raise InvalidRequestError("guided_whitespace_pattern is not supported", param="guided_whitespace_pattern")
    wanted = extra.get("guided_decoding_backend")
    if wanted is not None:
        if not isinstance(wanted, str):
            raise InvalidRequestError("guided_decoding_backend must be a string", param="guided_decoding_backend")
        if wanted not in AUTO_BACKENDS and (backend == "none" or wanted != backend):
            runs = "no grammar backend" if backend == "none" else f"only {backend}"
            raise InvalidRequestError(f"guided_decoding_backend {wanted!r} is not available: this server runs {runs}",
                                      param="guided_decoding_backend")
    found: list[Constraint] = []

    def add(spec: Optional[GrammarSpec], field: str) -> None:
        if spec is not None:
            found.append(Constraint(spec, field))

    add(_response_format(request.response_format) if request.response_format is not None else None,
        "response_format")
    for field, kind in (("regex", "regex"), ("json_schema", "json_schema"), ("ebnf", "ebnf"),
                        ("structural_tag", "structural_tag"), ("guided_json", "json_schema"),
                        ("guided_regex", "regex"), ("guided_grammar", "ebnf")):
        if extra.get(field) is not None:
            add(GrammarSpec(kind, _text(kind, extra[field], field)), field)
    if extra.get("guided_choice") is not None:
        add(GrammarSpec("ebnf", _choice(extra["guided_choice"], "guided_choice")), "guided_choice")
    if extra.get("structured_outputs") is not None:
        add(_structured_outputs(extra["structured_outputs"]), "structured_outputs")
    if len(found) > 1:
        names = " and ".join(c.field for c in found)
        raise InvalidRequestError(f"only one structured-output constraint may be given per request, got {names}",
                                  param=found[1].field)
    return found[0] if found else None


async def add_constraint(tm: Any, request: Any, sampling_params: dict[str, Any],
                         tool_constraint: Optional[Constraint] = None) -> Optional[Constraint]:
    """Check the request's constraint at the door (a 400 naming its field unless it compiles on this
    server: the tokenizer manager's `check_grammar`) and put it into `sampling_params`.
    `tool_constraint`: a chat request's forced tool calls, or its strict tools' calls under "auto"
    (chat_tools.ToolPlan.constraint), which take the request's one constraint. Returns the
    constraint put in (None: none)."""
    backend = tm.config.grammar_backend
    constraint = requested_constraint(request, backend)
    if tool_constraint is not None:
        if constraint is not None:
            raise InvalidRequestError(
                f"{constraint.field} cannot be combined with {tool_constraint.what}: that already constrains the "
                f"output ({tool_constraint.holds}), and a request takes one constraint", param=constraint.field)
        if backend == "none":
            # Said here rather than by check_grammar: the client asked for a tool option, not a schema.
            raise InvalidRequestError(
                f"{tool_constraint.what} needs constrained decoding, which is off on this server "
                f"(--grammar-backend none); to enable it, {how_to_enable()}", param=tool_constraint.asked_by)
        constraint = tool_constraint
    if constraint is None:
        return None
    for spec, field in constraint.parts:
        await tm.check_grammar(spec, field)
    await tm.check_grammar(constraint.spec, constraint.field)
    sampling_params[constraint.spec.kind] = constraint.spec.value
    return constraint
