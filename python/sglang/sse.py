"""Reading a server-sent event stream the way the SSE standard splits it into lines.

A line ends at CR, LF or CRLF, and nowhere else. `requests`' `Response.iter_lines(
decode_unicode=True)` splits with `str.splitlines()`, which also breaks at U+0085, U+2028 and
U+2029 (and a few control characters): an event whose JSON text holds one of them arrives in
pieces. This server escapes those characters (entrypoints/json_text.py), but a client should not
rely on it; `sse_lines` splits the raw bytes at the standard's line ends only, then decodes each
line (line ends are ASCII bytes, so no UTF-8 sequence is ever cut).
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Iterator

_LINE_END = re.compile(rb"\r\n|\r|\n")


def iter_sse_lines(chunks: Iterable[bytes]) -> Iterator[str]:
    """The lines (without their line ends) of a byte stream delivered in arbitrary chunks."""
    buf = b""
    for chunk in chunks:
        buf += chunk
        start = 0
        for m in _LINE_END.finditer(buf):
            if m.group() == b"\r" and m.end() == len(buf):
                break  # maybe the first half of a CRLF split across chunks: wait for the next one
            yield buf[start : m.start()].decode("utf-8")
            start = m.end()
        buf = buf[start:]
    if buf:
        yield buf.rstrip(b"\r").decode("utf-8")


def sse_lines(response: Any) -> Iterator[str]:
    """The lines of a streaming `requests.Response` (sent with `stream=True`)."""
    return iter_sse_lines(response.iter_content(chunk_size=None))
