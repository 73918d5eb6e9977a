"""A least-recently-used cache of compile outcomes by `GrammarSpec`, bounded in bytes.

Clients repeat their schemas (one per tool or task), so a compile is paid once per distinct spec;
a refusal (GrammarError) is kept too, so a client retrying a bad schema costs no compile either.
The bound is in bytes (a compiled grammar over a large vocabulary holds its token masks: MBs), each
entry counting its spec's text and the size the backend reports.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Optional

from sglang.srt.constrained.base import GrammarError
from sglang.srt.sampling.grammar_spec import GrammarSpec

DEFAULT_CACHE_BYTES = 512 << 20


class GrammarCache:
    def __init__(self, size_of: Callable[[Any], int], max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        """`size_of(compiled)`: the bytes a compiled grammar holds."""
        self._size_of = size_of
        self.max_bytes = max_bytes
        self._entries: OrderedDict[GrammarSpec, tuple[Any, int]] = OrderedDict()
        self.total_bytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, spec: GrammarSpec) -> bool:
        return spec in self._entries

    def get(self, spec: GrammarSpec) -> Optional[Any]:
        """The compiled grammar or the GrammarError of `spec` (now the most recently used), or None."""
        entry = self._entries.get(spec)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(spec)
        return entry[0]

    def put(self, spec: GrammarSpec, outcome: Any) -> None:
        """Keep `outcome` (a compiled grammar or a GrammarError) for `spec`, evicting the least
        recently used entries beyond the bound; an entry larger than the bound is not kept."""
        size = len(spec.value) + (len(str(outcome)) if isinstance(outcome, GrammarError) else self._size_of(outcome))
        old = self._entries.pop(spec, None)
        if old is not None:
            self.total_bytes -= old[1]
        if size > self.max_bytes:
            return
        self._entries[spec] = (outcome, size)
        self.total_bytes += size
        while self.total_bytes > self.max_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.total_bytes -= evicted

    def info(self) -> dict[str, int]:
        return {"entries": len(self._entries), "bytes": self.total_bytes, "hits": self.hits, "misses": self.misses}
