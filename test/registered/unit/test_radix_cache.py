"""RadixCache (mem_cache/radix_cache.py) on its own: matching, splitting, locks, LRU eviction,
namespaces that never alias, and the accounting invariant under a random workload."""

from __future__ import annotations

import random

import pytest
import torch

from sglang.srt.mem_cache.radix_cache import CacheNamespace, RadixCache

BASE = CacheNamespace()


class Slots:
    """A stand-in allocator: hands out fresh slot numbers and records what the cache frees."""

    def __init__(self) -> None:
        self.next = 1
        self.freed: list[int] = []

    def take(self, n: int) -> torch.Tensor:
        out = torch.arange(self.next, self.next + n, dtype=torch.int64)
        self.next += n
        return out

    def free(self, slots: torch.Tensor) -> None:
        self.freed += slots.tolist()


@pytest.fixture
def alloc() -> Slots:
    return Slots()


def test_match_insert_and_split(alloc):
    cache = RadixCache(alloc.free)
    a = alloc.take(6)
    assert cache.insert(BASE, [1, 2, 3, 4, 5, 6], a) == 0
    m = cache.match_prefix(BASE, [1, 2, 3, 9, 9])
    assert m.length == 3 and m.slots.tolist() == a[:3].tolist()
    # The node was split where the match ended: it covers exactly [1, 2, 3].
    assert m.node.key == [1, 2, 3] and list(m.node.children.values())[0].key == [4, 5, 6]
    b = alloc.take(5)
    assert cache.insert(BASE, [1, 2, 3, 7, 8], b) == 3  # 3 tokens were there: the caller frees b[:3]
    assert cache.match_prefix(BASE, [1, 2, 3, 7, 8, 0]).slots.tolist() == a[:3].tolist() + b[3:].tolist()
    assert cache.match_prefix(BASE, [1, 2, 3, 4, 5, 6], limit=4).length == 4
    assert cache.match_prefix(BASE, [2, 3]).length == 0 and cache.match_prefix(BASE, [2]).node is None
    assert cache.insert(BASE, [1, 2, 3, 4, 5, 6], alloc.take(6)) == 6
    assert cache.total_size == 8 and cache.evictable_size == 8 and cache.problems() == []


def test_namespaces_never_alias_even_when_their_strings_collide(alloc):
    """Adapter ids and salts are compared as a pair of values: names or salts chosen to collide
    as strings (an adapter id equal to a salt, "a:b" vs ("a", "b"), "None") still miss."""
    names = [
        CacheNamespace(),
        CacheNamespace("lora-1"),
        CacheNamespace(None, "lora-1"),
        CacheNamespace("lora-1", "s"),
        CacheNamespace("lora-1:s"),
        CacheNamespace(None, "lora-1:s"),
        CacheNamespace("None"),
        CacheNamespace(None, "None"),
        CacheNamespace("", None),
        CacheNamespace(None, ""),
    ]
    assert len(set(names)) == len(names)
    cache = RadixCache(alloc.free)
    prompt = list(range(10, 30))
    slots = {}
    for ns in names:
        assert cache.match_prefix(ns, prompt).length == 0, ns  # nothing leaks in from another one
        slots[ns] = alloc.take(len(prompt))
        assert cache.insert(ns, prompt, slots[ns]) == 0
    for ns in names:
        assert cache.match_prefix(ns, prompt).slots.tolist() == slots[ns].tolist()
    assert len(cache.roots) == len(names) and cache.problems() == []


def test_locks_protect_the_path_and_eviction_is_lru(alloc):
    cache = RadixCache(alloc.free)
    sys_prompt = [1, 2, 3, 4]
    old = alloc.take(6)
    cache.insert(BASE, sys_prompt + [5, 6], old)
    new = alloc.take(6)
    cache.insert(BASE, sys_prompt + [7, 8], new)  # splits: [1 2 3 4] -> [5 6], [7 8]
    hot = cache.match_prefix(BASE, sys_prompt + [5, 6])  # [5 6] is now the most recently used
    assert cache.unlocked_len(hot.node) == 6
    assert cache.inc_lock_ref(hot.node) == 6  # [1 2 3 4] and [5 6] protected
    assert (cache.evictable_size, cache.protected_size) == (2, 6)
    assert cache.unlocked_len(hot.node) == 0
    assert cache.evict(100) == 2  # only the unlocked leaf [7 8] can go
    assert alloc.freed == new[4:].tolist()
    assert cache.match_prefix(BASE, sys_prompt + [7, 8]).length == 4
    assert cache.dec_lock_ref(hot.node) == 6 and cache.protected_size == 0
    # Least recently used first: [5 6] (leaf), then its parent once it became a leaf.
    assert cache.evict(1) == 2 and alloc.freed[-2:] == old[4:].tolist()
    assert cache.evict(1) == 4 and cache.total_size == 0 and not cache.roots
    assert sorted(alloc.freed) == sorted(old.tolist() + new[4:].tolist())
    with pytest.raises(AssertionError):
        cache.dec_lock_ref(hot.node)


def test_lru_order_follows_lookups(alloc):
    cache = RadixCache(alloc.free)
    first, second = alloc.take(3), alloc.take(3)
    cache.insert(BASE, [1, 1, 1], first)
    cache.insert(BASE, [2, 2, 2], second)
    cache.match_prefix(BASE, [1, 1, 1])  # touch the older entry
    cache.evict(1)
    assert alloc.freed == second.tolist()


def test_a_split_keeps_its_locks(alloc):
    cache = RadixCache(alloc.free)
    cache.insert(BASE, [1, 2, 3, 4, 5], alloc.take(5))
    m = cache.match_prefix(BASE, [1, 2, 3, 4, 5])
    cache.inc_lock_ref(m.node)
    cache.insert(BASE, [1, 2, 9], alloc.take(3))  # splits the locked node under the lock
    assert (cache.protected_size, cache.evictable_size) == (5, 1) and cache.problems() == []
    assert cache.evict(10) == 1  # [9] only
    cache.dec_lock_ref(m.node)
    assert cache.evictable_size == 5 and cache.problems() == []


def test_evict_where_drops_one_namespace(alloc):
    cache = RadixCache(alloc.free)
    gone, kept = CacheNamespace("lora-a"), CacheNamespace("lora-b")
    cache.insert(gone, [1, 2, 3], alloc.take(3))
    cache.insert(kept, [1, 2, 3], alloc.take(3))
    locked = cache.match_prefix(gone, [1, 2, 3])
    cache.inc_lock_ref(locked.node)
    cache.insert(gone, [1, 2, 3, 4], alloc.take(4))
    assert cache.evict(10**9, where=lambda ns: ns == gone) == 1  # [4]; [1 2 3] is locked
    cache.dec_lock_ref(locked.node)
    assert cache.evict(10**9, where=lambda ns: ns == gone) == 3
    assert list(cache.roots) == [kept] and cache.total_size == 3


def test_reset_and_stats(alloc):
    cache = RadixCache(alloc.free)
    cache.insert(BASE, [1, 2, 3], alloc.take(3))
    cache.note_lookup(10, 3)
    cache.note_lookup(10, 0)
    s = cache.stats()
    assert (s.lookups, s.hits, s.hit_tokens, s.hit_rate, s.total_size) == (2, 1, 3, 0.15, 3)
    m = cache.match_prefix(BASE, [1, 2, 3])
    cache.inc_lock_ref(m.node)
    with pytest.raises(AssertionError):
        cache.reset()  # a running request holds it
    cache.dec_lock_ref(m.node)
    assert cache.reset() == 3 and cache.total_size == 0 and cache.stats().evicted_tokens == 3


def test_random_workload_keeps_the_invariant(alloc):
    """Inserts, lookups, locks, unlocks and evictions at random in three namespaces: the tree
    always agrees with its counters, and every slot is either cached once or was freed once."""
    rng = random.Random(0)
    cache = RadixCache(alloc.free)
    spaces = [CacheNamespace(), CacheNamespace("x"), CacheNamespace(None, "x")]
    stems = [[rng.randrange(5) for _ in range(rng.randint(1, 12))] for _ in range(6)]
    locked = []
    for step in range(600):
        ns = rng.choice(spaces)
        key = rng.choice(stems) + [rng.randrange(5) for _ in range(rng.randint(0, 6))]
        op = rng.random()
        if op < 0.45:
            slots = alloc.take(len(key))
            present = cache.insert(ns, key, slots)
            alloc.free(slots[:present])  # the caller's copies of what was cached already
        elif op < 0.7:
            m = cache.match_prefix(ns, key, limit=rng.randint(0, len(key)))
            if m.node is not None and rng.random() < 0.5:
                cache.inc_lock_ref(m.node)
                locked.append(m.node)
        elif op < 0.85 and locked:
            cache.dec_lock_ref(locked.pop(rng.randrange(len(locked))))
        else:
            cache.evict(rng.randint(1, 20))
        assert cache.problems() == [], step
    for node in locked:
        cache.dec_lock_ref(node)
    cached = cache.all_slots().tolist()
    assert len(cached) == cache.total_size == len(set(cached))
    assert sorted(cached + alloc.freed) == list(range(1, alloc.next))  # nothing lost, nothing twice
    cache.reset()
    assert sorted(alloc.freed) == list(range(1, alloc.next))


def test_prefix_len_is_a_read_only_match(alloc):
    """`prefix_len` (what --schedule-policy lpm ranks by) gives match_prefix's length without
    splitting a node, touching access times or building slots."""
    cache = RadixCache(alloc.free)
    cache.insert(BASE, [1, 2, 3, 4, 5, 6], alloc.take(6))
    cache.insert(BASE, [1, 2, 3, 9], alloc.take(4))
    other = CacheNamespace("adapter")
    before = [(n.key, n.last_access) for n in _nodes(cache)]
    assert cache.prefix_len(BASE, [1, 2, 3, 4, 5, 7]) == 5
    assert cache.prefix_len(BASE, [1, 2, 3, 9, 9]) == 4
    assert cache.prefix_len(BASE, [1, 2, 3, 4, 5, 6], limit=2) == 2
    assert cache.prefix_len(BASE, [8]) == 0 and cache.prefix_len(other, [1, 2, 3]) == 0
    assert [(n.key, n.last_access) for n in _nodes(cache)] == before
    for key in ([1, 2, 3, 4, 5, 7], [1, 2, 3, 9, 9], [2]):
        assert cache.prefix_len(BASE, key) == cache.match_prefix(BASE, key).length


def _nodes(cache):
    out, stack = [], list(cache.roots.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return sorted(out, key=lambda n: (len(n.key), n.key))
