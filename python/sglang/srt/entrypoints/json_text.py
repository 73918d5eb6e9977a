"""JSON text for HTTP bodies and server-sent events that every common line splitter keeps whole.

`json.dumps(..., ensure_ascii=False)` escapes every control character below U+0020 but leaves
three characters raw that Python's `str.splitlines()` (and so `requests`' `iter_lines(
decode_unicode=True)`, which many users' scripts read streams with) treats as line ends: U+0085
(NEL), U+2028 and U+2029. The SSE standard ends a line only at CR, LF or CRLF, so a conforming
client is fine, but a script splitting on those characters receives half an event. A model decodes
any byte sequence, so over many requests an event text holds one of them. Written as JSON escapes
(`\\u2028`) they keep the JSON valid and the decoded text identical.

Lone surrogates (U+D800-U+DFFF, which a JSON request can carry as `\\udcff` escapes, e.g. in a rid
or an adapter name echoed back) have no UTF-8 form: raw, they would fail the body's encoding. They
are written as JSON escapes too, which decode to the same string.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse

# For str.translate: the line breakers, and every surrogate code point.
_ESCAPES = {c: f"\\u{c:04x}" for c in (0x85, 0x2028, 0x2029, *range(0xD800, 0xE000))}


def dumps(payload: Any, allow_nan: bool = True, compact: bool = False) -> str:
    """`json.dumps` with non-ASCII text kept as is, except the three line-breaking characters and
    lone surrogates (escaped: the text always encodes as UTF-8)."""
    separators = (",", ":") if compact else None
    text = json.dumps(payload, ensure_ascii=False, allow_nan=allow_nan, separators=separators)
    return text.translate(_ESCAPES)


class JSONBody(JSONResponse):
    """The app's JSON response: starlette's (compact, no NaN), with the line breakers escaped."""

    def render(self, content: Any) -> bytes:
        return dumps(content, allow_nan=False, compact=True).encode("utf-8")
