"""Prefix cache: a radix tree over token ids whose nodes own KV slots (DESIGN §10).

Namespaces: every key lives under a `CacheNamespace(lora_id, cache_salt)`, and each namespace has
its own root. Namespaces are frozen dataclasses compared field by field, never strings built from
names, so KV computed under one adapter (or salt) is never found under another adapter, the base
model or another salt, whatever the adapter names and salts look like.

    roots[(None, None)] ── [1 2 3 4] ─┬─ [5 6]        node.key: token ids
                                      └─ [7]          node.value: their KV slots (host int64)
    roots[("lora-3f..", None)] ── [1 2 3 4 5 6]       same tokens, other KV: never shared

Locks: a running request locks the node where its cached prefix ends (`inc_lock_ref`), which
protects that node and its ancestors from eviction. Every cached token is either evictable (no
lock on its node) or protected, and `evictable_size + protected_size == total_size` is asserted
after every change. `evict(n)` frees least-recently-used unlocked leaves first, handing their slots
back through `free_slots`.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch

_NO_SLOTS = torch.zeros(0, dtype=torch.int64)


@dataclass(frozen=True)
class CacheNamespace:
    lora_id: Optional[str] = None  # adapter id, unique per load; None = the base model
    cache_salt: Optional[str] = None  # a client's tenant key; None = no salt


class TreeNode:
    __slots__ = ("key", "value", "children", "parent", "lock_ref", "last_access", "namespace")

    def __init__(self, key: list[int], value: torch.Tensor, parent: Optional["TreeNode"],
                 namespace: Optional[CacheNamespace] = None) -> None:
        self.key = key
        self.value = value  # KV slot of each token of `key`
        self.children: dict[int, TreeNode] = {}  # by first token
        self.parent = parent
        self.lock_ref = 0  # requests holding a lock on this node or a descendant
        self.last_access = 0
        self.namespace = namespace  # set on roots only

    @property
    def is_root(self) -> bool:
        return self.parent is None


@dataclass
class MatchResult:
    slots: torch.Tensor  # KV slots of the matched prefix (host int64)
    node: Optional[TreeNode]  # where the match ends (None for an empty match): lock it to keep it

    @property
    def length(self) -> int:
        return int(self.slots.numel())


@dataclass
class CacheStats:
    lookups: int = 0  # admissions that looked the cache up
    hits: int = 0  # ... and reused at least one token
    lookup_tokens: int = 0  # prompt tokens of those admissions
    hit_tokens: int = 0  # tokens reused from the cache
    evicted_tokens: int = 0
    total_size: int = 0
    evictable_size: int = 0
    protected_size: int = 0

    @property
    def hit_rate(self) -> float:
        """Share of looked-up prompt tokens served from the cache."""
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0


def _common_len(node_key: list[int], key: Sequence[int], start: int) -> int:
    n = len(node_key)
    if key[start : start + n] == node_key:  # the usual case, compared in C
        return n
    i = 0
    end = min(n, len(key) - start)
    while i < end and node_key[i] == key[start + i]:
        i += 1
    return i


class RadixCache:
    def __init__(self, free_slots: Callable[[torch.Tensor], None]) -> None:
        self.free_slots = free_slots
        self.roots: dict[CacheNamespace, TreeNode] = {}
        self.total_size = self.evictable_size = self.protected_size = 0
        self.stats_counts = CacheStats()
        self._clock = 0

    # ------------------------------------------------------------------ lookup and insert
    def match_prefix(self, namespace: CacheNamespace, key: Sequence[int], limit: Optional[int] = None
                     ) -> MatchResult:
        """The longest cached prefix of `key[:limit]` in `namespace`. A node the match ends inside
        is split, so the returned node covers exactly the matched tokens."""
        key = key if limit is None else key[: max(limit, 0)]
        node = self.roots.get(namespace)
        if node is None:
            return MatchResult(_NO_SLOTS, None)
        self._clock += 1
        parts, i = [], 0
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                break
            n = _common_len(child.key, key, i)
            child.last_access = self._clock
            if n < len(child.key):
                child = self._split(child, n)
            parts.append(child.value)
            node, i = child, i + n  # after a split the next lookup fails: the keys diverged here
        if not parts:
            return MatchResult(_NO_SLOTS, None)
        return MatchResult(torch.cat(parts), node)

    def prefix_len(self, namespace: CacheNamespace, key: Sequence[int], limit: Optional[int] = None) -> int:
        """How many leading tokens of `key[:limit]` are cached in `namespace`: a read-only
        `match_prefix` (no split, no access time, no slots), for ranking requests."""
        key = key if limit is None else key[: max(limit, 0)]
        node, i = self.roots.get(namespace), 0
        while node is not None and i < len(key):
            child = node.children.get(key[i])
            if child is None:
                break
            n = _common_len(child.key, key, i)
            i += n
            node = child if n == len(child.key) else None
        return i

    def insert(self, namespace: CacheNamespace, key: Sequence[int], slots: torch.Tensor) -> int:
        """Cache the KV `slots` of tokens `key`. Returns how many leading tokens were cached
        already: the tree keeps its own slots for those, and the caller frees its copies."""
        assert len(key) == slots.numel(), (len(key), slots.numel())
        if not key:
            return 0
        node = self.roots.get(namespace)
        if node is None:
            node = self.roots[namespace] = TreeNode([], _NO_SLOTS, None, namespace)
        self._clock += 1
        i = 0
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                leaf = TreeNode(list(key[i:]), slots[i:].to(torch.int64).clone(), node)
                leaf.last_access = self._clock
                node.children[key[i]] = leaf
                self.total_size += len(leaf.key)
                self.evictable_size += len(leaf.key)
                self._check_sizes()
                return i
            n = _common_len(child.key, key, i)
            child.last_access = self._clock
            if n < len(child.key):
                child = self._split(child, n)
            node, i = child, i + n
        return i

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child` after its first n tokens; returns the new upper part (same locks)."""
        upper = TreeNode(child.key[:n], child.value[:n], child.parent)
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        child.parent.children[child.key[0]] = upper
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        upper.children[child.key[0]] = child
        return upper

    # ------------------------------------------------------------------ locks
    def unlocked_len(self, node: Optional[TreeNode]) -> int:
        """Tokens that locking `node` would move from evictable to protected."""
        n = 0
        while node is not None and not node.is_root:
            n += len(node.key) if node.lock_ref == 0 else 0
            node = node.parent
        return n

    def inc_lock_ref(self, node: Optional[TreeNode]) -> int:
        """Protect `node` and its ancestors; returns the tokens that stopped being evictable."""
        moved = 0
        while node is not None and not node.is_root:
            if node.lock_ref == 0:
                moved += len(node.key)
            node.lock_ref += 1
            node = node.parent
        self.evictable_size -= moved
        self.protected_size += moved
        self._check_sizes()
        return moved

    def dec_lock_ref(self, node: Optional[TreeNode]) -> int:
        """Undo one `inc_lock_ref(node)`; returns the tokens that became evictable."""
        moved = 0
        while node is not None and not node.is_root:
            assert node.lock_ref > 0, "dec_lock_ref without a matching inc_lock_ref"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                moved += len(node.key)
            node = node.parent
        self.evictable_size += moved
        self.protected_size -= moved
        self._check_sizes()
        return moved

    # ------------------------------------------------------------------ eviction
    def evict(self, num_tokens: int, where: Optional[Callable[[CacheNamespace], bool]] = None) -> int:
        """Free at least `num_tokens` (or all there is) from unlocked leaves, least recently used
        first, in the namespaces `where` accepts (all by default). Returns the tokens freed."""
        roots = [r for ns, r in self.roots.items() if where is None or where(ns)]
        heap = [(n.last_access, id(n), n) for r in roots for n in self._walk(r)
                if not n.children and not n.is_root and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        values: list[torch.Tensor] = []
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            values.append(node.value)
            freed += len(node.key)
            parent = node.parent
            del parent.children[node.key[0]]
            if parent.is_root:
                if not parent.children:
                    del self.roots[parent.namespace]
            elif not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        if values:  # one call: the allocator's free concatenates its whole free list each time
            self.free_slots(torch.cat(values))
        self.total_size -= freed
        self.evictable_size -= freed
        self.stats_counts.evicted_tokens += freed
        self._check_sizes()
        return freed

    def reset(self) -> int:
        """Free everything (nothing may be locked). Returns the tokens freed."""
        assert self.protected_size == 0, "reset() while requests hold cached prefixes"
        freed = self.evict(self.total_size)
        assert not self.roots and self.total_size == 0
        return freed

    # ------------------------------------------------------------------ views and checks
    def note_lookup(self, num_tokens: int, num_hit: int) -> None:
        s = self.stats_counts
        s.lookups += 1
        s.hits += num_hit > 0
        s.lookup_tokens += num_tokens
        s.hit_tokens += num_hit

    def stats(self) -> CacheStats:
        s = self.stats_counts
        return CacheStats(s.lookups, s.hits, s.lookup_tokens, s.hit_tokens, s.evicted_tokens,
                          self.total_size, self.evictable_size, self.protected_size)

    def all_slots(self) -> torch.Tensor:
        values = [n.value for r in self.roots.values() for n in self._walk(r)]
        return torch.cat(values) if values else _NO_SLOTS

    def _walk(self, root: TreeNode) -> Iterator[TreeNode]:
        stack = [root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _check_sizes(self) -> None:
        assert self.evictable_size + self.protected_size == self.total_size, (
            self.evictable_size, self.protected_size, self.total_size)
        assert min(self.evictable_size, self.protected_size) >= 0

    def problems(self) -> list[str]:
        """A full walk of the tree against its counters (for the integrity check)."""
        out: list[str] = []
        total = evictable = 0
        for ns, root in self.roots.items():
            if root.namespace != ns or root.key or root.lock_ref:
                out.append(f"root of {ns} is malformed")
            if not root.children:
                out.append(f"namespace {ns} has an empty root")
            for node in self._walk(root):
                for first, child in node.children.items():
                    if child.parent is not node or not child.key or child.key[0] != first:
                        out.append(f"{ns}: a child is linked wrongly")
                    if child.lock_ref > node.lock_ref and not node.is_root:
                        out.append(f"{ns}: a node has more locks than its parent")
                if node.is_root:
                    continue
                if node.value.numel() != len(node.key):
                    out.append(f"{ns}: a node holds {node.value.numel()} slots for {len(node.key)} tokens")
                total += len(node.key)
                evictable += len(node.key) if node.lock_ref == 0 else 0
        if (total, evictable, total - evictable) != (self.total_size, self.evictable_size, self.protected_size):
            out.append(f"counters say {self.total_size} cached = {self.evictable_size} evictable + "
                       f"{self.protected_size} protected, the tree holds {total} = {evictable} + "
                       f"{total - evictable}")
        return out
