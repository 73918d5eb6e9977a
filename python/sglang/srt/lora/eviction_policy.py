"""Which resident adapter leaves the GPU pool when a new one needs its slot.

The pool decides *who may* be evicted (not in the current batch, not pinned); a policy only
decides *who is* evicted among those candidates.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Optional


class EvictionPolicy:
    name = "base"

    def __init__(self) -> None:
        # lora_id -> None, oldest first; the meaning of "old" is the policy's.
        self._order: OrderedDict[Optional[str], None] = OrderedDict()

    def mark_used(self, lora_id: Optional[str]) -> None:
        raise NotImplementedError

    def remove(self, lora_id: Optional[str]) -> None:
        self._order.pop(lora_id, None)

    def select_victim(self, candidates: Iterable[Optional[str]]) -> Optional[str]:
        cands = set(candidates)
        if not cands:
            raise ValueError("no eviction candidate")
        for lora_id in self._order:
            if lora_id in cands:
                return lora_id
        # A candidate the policy never saw (should not happen): pick deterministically.
        return sorted(cands, key=lambda u: (u is not None, u or ""))[0]


class LRUEvictionPolicy(EvictionPolicy):
    """Evict the adapter used longest ago."""

    name = "lru"

    def mark_used(self, lora_id: Optional[str]) -> None:
        self._order[lora_id] = None
        self._order.move_to_end(lora_id)


class FIFOEvictionPolicy(EvictionPolicy):
    """Evict the adapter loaded earliest, however recently it was used."""

    name = "fifo"

    def mark_used(self, lora_id: Optional[str]) -> None:
        if lora_id not in self._order:
            self._order[lora_id] = None


def get_eviction_policy(name: str) -> EvictionPolicy:
    policies = {"lru": LRUEvictionPolicy, "fifo": FIFOEvictionPolicy}
    if name not in policies:
        raise ValueError(f"Unknown --lora-eviction-policy {name!r}; choose one of {sorted(policies)}")
    return policies[name]()
