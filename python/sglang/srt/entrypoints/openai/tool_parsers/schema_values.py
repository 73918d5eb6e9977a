"""Parameter values written as raw text (Qwen3-Coder's `<parameter=NAME>` blocks) made JSON values,
by the type the request's tool schema gives the parameter.

The model writes `3`, `true`, `[1, 2]` or `Paris` alike, without quotes; only the schema says
whether `3` is the number or the string. A value that does not read as its type stays the string
it is (the tool gets what the model wrote rather than nothing). The type is the schema's `type`,
else that of its `enum` / `const` values, else its anyOf / oneOf / allOf branches', local `$ref`s
followed. Without one (no schema for the parameter, or one that does not say), a value that is JSON
is taken as JSON, any other as a string.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from sglang.srt.entrypoints.openai.tool_parsers.base import strict_json

_NOT = object()  # "does not read as this type"


# How many `$ref`s deep a parameter's type is looked for (a recursive schema refers to itself).
_MAX_REF_DEPTH = 16


def parameter_schemas(tools: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """{function name: {parameter name: its JSON schema}} of (checked) OpenAI tool definitions,
    each parameter's local `$ref`s that say its type resolved (see _typing_schema)."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters") or {}
        props = params.get("properties") if isinstance(params, Mapping) else None
        out[fn["name"]] = ({k: _typing_schema(v, params) for k, v in props.items() if isinstance(v, Mapping)}
                           if isinstance(props, Mapping) else {})
    return out


def _pointer(root: Mapping[str, Any], ref: str) -> Optional[Mapping[str, Any]]:
    """The schema a local `$ref` ("#", "#/$defs/X", ...) points at within `root`; None if it
    points elsewhere (another document) or at nothing."""
    if ref != "#" and not ref.startswith("#/"):
        return None
    node: Any = root
    for part in ref[2:].split("/") if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if isinstance(node, Mapping) else None


def _typing_schema(schema: Mapping[str, Any], root: Mapping[str, Any], depth: int = 0) -> Mapping[str, Any]:
    """`schema` with the `$ref`s that say its type (its own, its anyOf / oneOf / allOf branches')
    replaced by the schemas they point at in `root` (the tool's `parameters`). Generated schemas
    (pydantic's) refer to every enum and nested model: unresolved, a string parameter would have no
    type and `75001` would become a number, against the schema (and a strict tool's grammar)."""
    if depth > _MAX_REF_DEPTH:
        return schema
    ref = schema.get("$ref")
    if isinstance(ref, str):
        target = _pointer(root, ref)
        if target is not None:  # the keywords beside the $ref (a description, ...) apply too
            merged = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
            if "$ref" in target:
                merged["$ref"] = target["$ref"]
            return _typing_schema(merged, root, depth + 1)
    out = dict(schema)
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(out.get(key), list):
            out[key] = [_typing_schema(b, root, depth + 1) if isinstance(b, Mapping) else b for b in out[key]]
    return out


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if value is None:
        return "null"
    return {str: "string", list: "array", dict: "object"}.get(type(value), "string")


def schema_types(schema: Optional[Mapping[str, Any]]) -> list[str]:
    """The JSON types a schema allows, in its order: `type` (a name or a list), else those of its
    `const` or `enum` values, else the types of its anyOf / oneOf / allOf branches; [] when it does
    not say."""
    if not isinstance(schema, Mapping):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    out: list[str] = []
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if isinstance(values, list):
        for v in values:
            if _json_type(v) not in out:
                out.append(_json_type(v))
        return out
    for key in ("anyOf", "oneOf", "allOf"):
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
