"""The xgrammar grammar backend (xgrammar's public API only: TokenizerInfo, GrammarCompiler,
GrammarMatcher). Imported only by `create_grammar_backend("xgrammar", ...)`.

A structural tag's JSON schemas get what a JSON schema gets (bounded white space, bounded strings as
patterns) before it is compiled, so a schema means the same alone and inside a structural tag.

The tokenizer's vocabulary is read once, at the first compile (a large vocabulary takes a while,
and a server that never constrains never pays it). xgrammar's own compile cache is off: the callers
keep compiled grammars in their own LRU (constrained/cache.py), which also remembers refusals.
"""

from __future__ import annotations

import json
import os
import re
import threading
from typing import Any, Callable, Optional, Sequence

import torch
import xgrammar as xgr

from sglang.srt.constrained.base import GrammarError
from sglang.srt.sampling.grammar_spec import GrammarSpec

# xgrammar's errors start with a log prefix ("[12:00:00] /project/cpp/regex_converter.cc:83: ") and
# sometimes a failed check's text; what follows is the message meant for the user.
_LOG_PREFIX = re.compile(r"^\[\d\d:\d\d:\d\d\] \S+:\d+: ")
_CHECK_PREFIX = re.compile(r"^Check failed: .*? is false: ")
# The kind of error a structural tag's compile names first, which the caller's message already says.
_KIND_PREFIX = re.compile(r"^Invalid (structural tag|JSON) error: ")
MAX_ERROR_CHARS = 1000
# JSON may have white space between its elements (models write indented JSON), at most this many
# characters in a row: without a bound a model can loop on white space until max_new_tokens, a known
# failure of unbounded JSON grammars (vLLM's and SGLang's users meet it with small models). 32 covers a
# line break and indentation seven levels deep at four spaces; deeper, the JSON is written tighter.
JSON_MAX_WHITESPACE = 32


# Keywords whose value is a subschema, a list of them, or a name -> subschema map.
_SUBSCHEMA = ("additionalProperties", "items", "not", "if", "then", "else", "contains", "unevaluatedProperties",
              "unevaluatedItems", "propertyNames")
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def bounded_strings_as_patterns(schema: Any) -> Any:
    """`schema` with every string bounded by minLength / maxLength alone rewritten as the same
    bound on a `pattern`. xgrammar 0.2.8 compiles such a bound to a bare character class that lets
    raw control characters (U+0000-U+001F but CR and LF) into the string, which is invalid JSON
    (xgrammar issue #800): a tab in a `maxLength` field breaks `json.loads`. Its `pattern` path
    reads the regex as a JSON string's characters and never emits them. Other schemas are kept."""
    if isinstance(schema, list):
        return [bounded_strings_as_patterns(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), (dict, list)):
            out[key] = bounded_strings_as_patterns(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [bounded_strings_as_patterns(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: bounded_strings_as_patterns(s) for name, s in out[key].items()}
    lo, hi = out.get("minLength"), out.get("maxLength")
    bounds_ok = all(v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0) for v in (lo, hi))
    if (out.get("type") == "string" and (lo is not None or hi is not None) and bounds_ok
            and "pattern" not in out and "format" not in out and (lo or 0) <= (hi if hi is not None else lo or 0)):
        out.pop("minLength", None)
        out.pop("maxLength", None)
        out["pattern"] = "[\\s\\S]{%d,%s}" % (lo or 0, "" if hi is None else hi)
    return out


def _rewritten_json(text: str, rewrite: Callable[[Any], Any]) -> str:
    """`text` parsed, rewritten and serialised again; as it is when it is not JSON (xgrammar then
    says what is wrong with it)."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return json.dumps(rewrite(value), ensure_ascii=False)


def _json_schema_text(text: str) -> str:
    return _rewritten_json(text, bounded_strings_as_patterns)


def _structural_format(fmt: Any) -> Any:
    """A structural tag's format tree with every JSON-style `json_schema` node given the same
    treatment as a JSON schema constraint; other nodes (and other styles: Qwen's XML parameters
    hold raw text, not JSON strings) are kept."""
    if isinstance(fmt, list):
        return [_structural_format(f) for f in fmt]
    if not isinstance(fmt, dict):
        return fmt
    out = {key: _structural_format(value) for key, value in fmt.items() if key != "json_schema"}
    if "json_schema" in fmt:
        out["json_schema"] = fmt["json_schema"]
    if fmt.get("type") == "json_schema" and fmt.get("style", "json") == "json":
        out["json_schema"] = bounded_strings_as_patterns(fmt.get("json_schema"))
        out.setdefault("max_whitespace_cnt", JSON_MAX_WHITESPACE)
    return out


def _structural_tag_text(text: str) -> str:
    return _rewritten_json(text, _structural_format)


def clean_error(e: BaseException) -> str:
    text = str(e).strip()
    text = _LOG_PREFIX.sub("", text)
    text = _CHECK_PREFIX.sub("", text).strip()
    text = _KIND_PREFIX.sub("", text)
    if len(text) > MAX_ERROR_CHARS:
        text = text[:MAX_ERROR_CHARS] + "..."
    return text or type(e).__name__


class XGrammarMatcher:
    """xgrammar's GrammarMatcher behind the GrammarMatcher interface."""

    __slots__ = ("_m",)

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._m = matcher

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        return bool(self._m.fill_next_token_bitmask(bitmask, row))

    def accept_token(self, token_id: int) -> bool:
        return bool(self._m.accept_token(int(token_id)))

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(set(stop_token_ids))
        self._compiler: Optional[xgr.GrammarCompiler] = None
        self._lock = threading.Lock()  # compiles may run in worker threads

    def _get_compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=min(8, os.cpu_count() or 1),
                                                     cache_enabled=False)
            return self._compiler

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        compiler = self._get_compiler()
        try:
            if spec.kind == "regex":
                return compiler.compile_regex(spec.value)
            if spec.kind == "json_schema":
                return compiler.compile_json_schema(_json_schema_text(spec.value),
                                                    max_whitespace_cnt=JSON_MAX_WHITESPACE)
            if spec.kind == "structural_tag":
                return compiler.compile_structural_tag(_structural_tag_text(spec.value))
            return compiler.compile_grammar(spec.value)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's parse and conversion errors
            raise GrammarError(clean_error(e)) from None

    def matcher(self, compiled: xgr.CompiledGrammar) -> XGrammarMatcher:
        return XGrammarMatcher(xgr.GrammarMatcher(compiled))

    def size_of(self, compiled: xgr.CompiledGrammar) -> int:
        return int(compiled.memory_size_bytes)
