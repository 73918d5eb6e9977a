"""Parameter values written as raw text (Qwen3-Coder's `<parameter=NAME>` blocks) made JSON values,
by the type the request's tool schema gives the parameter.

The model writes `3`, `true`, `[1, 2]` or `Paris` alike, without quotes; only the schema says
whether `3` is the number or the string. A value that does not read as its type stays the string
it is (the tool gets what the model wrote rather than nothing). Without a type (no schema for the
parameter, or one without `type`), a value that is JSON is taken as JSON, any other as a string.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from sglang.srt.entrypoints.openai.tool_parsers.base import strict_json

_NOT = object()  # "does not read as this type"


def parameter_schemas(tools: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """{function name: {parameter name: its JSON schema}} of (checked) OpenAI tool definitions."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters") or {}
        props = params.get("properties") if isinstance(params, Mapping) else None
        out[fn["name"]] = {k: v for k, v in props.items() if isinstance(v, Mapping)} if isinstance(props, Mapping) else {}
    return out


def schema_types(schema: Optional[Mapping[str, Any]]) -> list[str]:
    """The JSON types a schema allows, in its order: `type` (a name or a list), else the types of
    its anyOf / oneOf branches; [] when it does not say."""
    if not isinstance(schema, Mapping):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    out: list[str] = []
    for key in ("anyOf", "oneOf"):
        for branch in schema.get(key) or []:
            out += [k for k in schema_types(branch) if k not in out]
    return out


def typed_value(raw: str, schema: Optional[Mapping[str, Any]]) -> Any:
    """`raw` as the JSON value the schema's type makes it (see the module docstring). A schema of
    several types tries them in its order, the string last: the model writes no quotes, so a
    string type would otherwise take every value."""
    types = schema_types(schema)
    if not types:
        value = _json(raw)
        return raw if value is _NOT else value
    for kind in [t for t in types if t != "string"]:
        value = _as_type(raw, kind)
        if value is not _NOT:
            return value
    return raw


def _as_type(raw: str, kind: str) -> Any:
    text = raw.strip()
    if kind in ("integer", "number"):
        value = _json(text)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return _NOT
        # An integer written `3.0` is the integer; a fraction where an integer is due is still the
        # number the model wrote (closer to its intent than the string).
        return int(value) if kind == "integer" and isinstance(value, float) and value.is_integer() else value
    if kind == "boolean":
        return {"true": True, "false": False}.get(text.lower(), _NOT)
    if kind == "null":
        return None if text == "null" else _NOT
    if kind in ("object", "array"):
        value = _json(text)
        return value if isinstance(value, dict if kind == "object" else list) else _NOT
    return _NOT


def _json(text: str) -> Any:
    """base.strict_json of `text` (NaN and infinities refused), or _NOT (a JSON null is None)."""
    try:
        return strict_json(text)
    except (ValueError, RecursionError):
        return _NOT
