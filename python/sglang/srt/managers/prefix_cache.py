"""The scheduler's side of the radix cache (DESIGN §10): what a request reuses, locks and leaves.

A request's row of `req_to_token` holds `kv_len` KV slots; the first `cache_len` belong to the tree
(locked through `req.cache_node` while the request runs), the rest to the request. Its life:
  * admission (`match`, `admit`; called by plan_prefill): the longest cached prefix of its tokens
    in its namespace (adapter, salt), at most `req.cacheable_len`; the prefix is locked and
    written into a fresh row, so only the suffix is prefilled;
  * after every prefill pass (`cache_unfinished`): the pass's tokens join the tree at once, so the
    next chunk and concurrent requests with the same prefix reuse them; where another request
    cached the same tokens first, the request's copies are freed and its row points at the tree's;
  * finish and retraction (`release(insert=True)`): everything computed (prompt and output) joins
    the tree and the lock is dropped. Aborts and failed passes (`insert=False`) free the request's
    own slots uncached: a failed pass may have left them unwritten.
Accounting: free + cached (evictable + protected) + owned by requests == total KV slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from sglang.srt.managers.req import Req
from sglang.srt.mem_cache.radix_cache import CacheNamespace, RadixCache, TreeNode

if TYPE_CHECKING:
    from sglang.srt.model_executor.model_runner import ModelRunner

# In-batch deduplication: two waiting requests whose next uncached tokens start alike over this
# many tokens are taken to share a prefix; the second waits one turn and reuses the first's KV.
DEDUP_PROBE_TOKENS = 32


@dataclass
class PrefixHit:
    length: int  # cached tokens the request would reuse
    cost: int  # evictable tokens its lock would protect (they leave the admission budget)
    node: Optional[TreeNode]
    slots: torch.Tensor
    probe: tuple[CacheNamespace, tuple[int, ...]]  # the next uncached tokens (in-batch dedup key)


class PrefixCache:
    def __init__(self, model_runner: "ModelRunner") -> None:
        self.pool = model_runner.req_to_token_pool
        self.allocator = model_runner.token_to_kv_pool_allocator
        self.tree = RadixCache(self.allocator.free)
        self._probes: set[tuple[CacheNamespace, tuple[int, ...]]] = set()
        self.turn_hit_tokens = 0  # tokens reused by the requests admitted this turn (for the log)

    # ------------------------------------------------------------------ sizes
    @property
    def evictable_size(self) -> int:
        return self.tree.evictable_size

    def evict(self, num_tokens: int) -> int:
        return self.tree.evict(num_tokens)

    # ------------------------------------------------------------------ admission (plan_prefill)
    def begin_turn(self) -> None:
        self._probes.clear()
        self.turn_hit_tokens = 0

    def cached_len(self, req: Req) -> int:
        """Tokens of the request a hit would reuse now (read-only: for `--schedule-policy lpm`)."""
        return self.tree.prefix_len(req.namespace, req.fill_ids, req.cacheable_len)

    def match(self, req: Req) -> PrefixHit:
        ids = req.fill_ids  # built on each access: once here
        m = self.tree.match_prefix(req.namespace, ids, req.cacheable_len)
        probe = (req.namespace, tuple(ids[m.length : m.length + DEDUP_PROBE_TOKENS]))
        return PrefixHit(m.length, self.tree.unlocked_len(m.node), m.node, m.slots, probe)

    def defer(self, req: Req, hit: PrefixHit) -> bool:
        return len(hit.probe[1]) == DEDUP_PROBE_TOKENS and hit.probe in self._probes

    def admit(self, req: Req, hit: PrefixHit) -> None:
        """Lock the hit, give the request a row holding it; the planner sets `extend_len`."""
        assert req.req_pool_idx is None and req.kv_len == 0, req
        rows = self.pool.alloc(1)
        assert rows is not None, "admission let in more requests than there are rows"
        self.tree.inc_lock_ref(hit.node)
        req.req_pool_idx, req.cache_node = rows[0], hit.node
        req.kv_len = req.cache_len = hit.length
        if hit.length:
            self.pool.write(req.req_pool_idx, 0, hit.slots)
        if not req.output_ids:  # a first admission (not a retracted request coming back)
            req.cached_tokens = hit.length
            self.tree.note_lookup(len(req.origin_input_ids), hit.length)
        self.turn_hit_tokens += hit.length
        self._probes.add(hit.probe)

    # ------------------------------------------------------------------ after a pass, at the end
    def _row_slots(self, reqs: list[Req]) -> torch.Tensor:
        """The KV slots of the requests' rows, [len(reqs), max kv_len], from the pool's host twin."""
        return self.pool.slots([r.req_pool_idx for r in reqs], max(r.kv_len for r in reqs))

    def _insert(self, req: Req, slots: torch.Tensor) -> int:
        """Put the request's computed tokens in the tree and free its copies of tokens that were
        there already. Returns how many leading tokens the tree had."""
        present = self.tree.insert(req.namespace, req.fill_ids[: req.kv_len], slots[: req.kv_len])
        assert present >= req.cache_len, "the request's locked prefix vanished from the tree"
        self.allocator.free(slots[req.cache_len : present])
        return present

    def cache_unfinished(self, reqs: list[Req]) -> None:
        """After a prefill pass: cache what the still-running requests computed, keep it locked."""
        reqs = [r for r in reqs if r.req_pool_idx is not None and r.kv_len > r.cache_len]
        if not reqs:
            return
        table = self._row_slots(reqs)
        for req, slots in zip(reqs, table):
            present = self._insert(req, slots)
            m = self.tree.match_prefix(req.namespace, req.fill_ids, req.kv_len)
            assert m.length == req.kv_len, (m.length, req.kv_len)
            if present > req.cache_len:  # point the row at the tree's copies
                self.pool.write(req.req_pool_idx, req.cache_len, m.slots[req.cache_len : present])
            self.tree.inc_lock_ref(m.node)
            self.tree.dec_lock_ref(req.cache_node)
            req.cache_node, req.cache_len = m.node, req.kv_len

    def release(self, req: Req, insert: bool) -> None:
        """Give back the request's row, its own slots (cached first if `insert`) and its lock.
        Idempotent."""
        if req.req_pool_idx is not None:
            if req.kv_len > req.cache_len:
                slots = self._row_slots([req])[0]
                if insert:
                    self._insert(req, slots)
                else:
                    self.allocator.free(slots[req.cache_len : req.kv_len])
            self.pool.free(req.req_pool_idx)
        self.tree.dec_lock_ref(req.cache_node)
        req.req_pool_idx, req.cache_node = None, None
        req.kv_len = req.cache_len = 0

    # ------------------------------------------------------------------ control
    def drop_namespaces(self, stale: Callable[[CacheNamespace], bool]) -> int:
        """Free every unlocked entry of the namespaces `stale` names (e.g. an unloaded adapter's);
        entries still locked become evictable once their requests end."""
        return self.tree.evict(self.tree.total_size, where=stale)

    def flush(self) -> int:
        return self.tree.reset()

    def info(self) -> dict[str, Any]:
        s = self.tree.stats()
        return {
            "enabled": True, "hit_rate": round(s.hit_rate, 4), "cached_tokens": s.hit_tokens,
            "lookup_tokens": s.lookup_tokens, "lookups": s.lookups, "hits": s.hits,
            "size": s.total_size, "evictable_size": s.evictable_size, "protected_size": s.protected_size,
            "evicted_tokens": s.evicted_tokens, "namespaces": len(self.tree.roots),
        }
