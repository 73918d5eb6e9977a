"""The scheduler's admission and retraction (a mixin of `Scheduler`).

Admission: prefill first, FCFS (or longest cached prefix first), chunked, within the KV, row,
token and LoRA budgets of schedule_policy.py; else one decode step of every running request.
Retraction: when decode finds no free KV slot it retracts the newest running requests back to the
queue (they give their KV back and are prefilled again later, resuming where they stopped). Cached
KV counts as available: the prefix cache evicts it before anything is retracted.

`new_token_ratio` is the share of a running request's remaining budget that admission reserves: it
jumps to 1 after a retraction and decays by NEW_TOKEN_RATIO_DECAY per decode step.
"""

from __future__ import annotations

import bisect
import logging
from typing import Optional

from sglang.srt.configs.forward_batch_info import ForwardMode
from sglang.srt.managers.req import Req
from sglang.srt.managers.schedule_policy import PrefillBudget, longest_prefix_first, plan_prefill

# The scheduler's own logger: these mixins are parts of the Scheduler, and operators filter its
# log lines ("Prefill batch, ...") by that name.
logger = logging.getLogger("sglang.srt.managers.scheduler")

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.0015  # per decode step


class SchedulerAdmissionMixin:
    """Reads and updates the Scheduler's queues (`waiting`, `running`, `chunked_req`), its pools
    and `new_token_ratio`."""

    def get_next_batch(self) -> Optional[tuple[ForwardMode, list[Req]]]:
        """Prefill first; else decode every running request (retracting if KV ran out)."""
        if self.waiting or self.chunked_req is not None:
            batch = self._plan_prefill()
            if batch is not None:
                return batch
        if not self.running:
            return None
        self.retract_for_decode()
        if not self.running:
            return None
        return ForwardMode.DECODE, list(self.running)

    def _plan_prefill(self) -> Optional[tuple[ForwardMode, list[Req]]]:
        holders = self._holders()
        self.lora_admission.begin({r.lora_id for r in holders}, self.waiting, holders)
        holding = len(self.running) + (self.chunked_req is not None)
        chunk = self.config.runner.chunked_prefill_size
        max_prefill_tokens = self.config.runner.max_prefill_tokens
        if self.prefix_cache is not None:
            self.prefix_cache.begin_turn()
        budget = PrefillBudget(
            kv_free=self._kv_available(),
            rows_free=self.req_to_token_pool.available_size(),
            max_new_reqs=self.max_running_requests - holding,
            max_prefill_tokens=max_prefill_tokens,
            chunk_size=None if chunk == -1 else min(chunk, max_prefill_tokens),
            new_token_ratio=self.new_token_ratio,
        )
        waiting = self.waiting
        # Ranking walks the tree for every waiting request: only on turns that can admit one.
        if self.longest_prefix_first and min(budget.rows_free, budget.max_new_reqs) > 0:
            waiting = longest_prefix_first(waiting, self.prefix_cache.cached_len)
        plan = plan_prefill(
            self.lora_admission.order(waiting), self.chunked_req, self.running, budget, self.lora_admission,
            self.prefix_cache,
        )
        if plan.reqs:
            admitted = {id(r) for r in plan.reqs}
            self.waiting = [r for r in self.waiting if id(r) not in admitted]
            self.chunked_req = plan.chunked
            return ForwardMode.EXTEND, plan.reqs
        return None

    def retract_for_decode(self) -> None:
        """Retract the newest running requests until every remaining one gets a KV slot (cached
        KV counts as available: it is evicted first)."""
        retracted = []
        while self.running and self._kv_available() < len(self.running):
            newest = max(self.running, key=lambda r: r.arrival)
            self.running.remove(newest)
            self._release(newest, insert=True)
            bisect.insort(self.waiting, newest, key=lambda r: r.arrival)
            retracted.append(newest)
        if retracted:
            old = self.new_token_ratio
            # Reserve more for the requests still running, so admission stops over-committing.
            self.new_token_ratio = 1.0
            self.stats["num_retractions"] += len(retracted)
            logger.warning(
                "KV cache pool is full. Retract requests. #retracted-req: %d, #running-req: %d, "
                "#new-token-ratio: %.4f -> %.4f", len(retracted), len(self.running), old, self.new_token_ratio,
            )

    def decay_new_token_ratio(self) -> None:
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)

    # ------------------------------------------------------------------ what is held
    def _holders(self) -> list[Req]:
        """The requests that hold KV: the running ones and the one being prefilled in chunks."""
        return self.running + ([self.chunked_req] if self.chunked_req is not None else [])

    def _kv_available(self) -> int:
        """Free KV slots, or held by the cache but evictable: what new requests can get."""
        evictable = self.prefix_cache.evictable_size if self.prefix_cache is not None else 0
        return self.allocator.available_size() + evictable

    def _kv_used(self) -> int:
        """KV slots held by running requests, directly or through the cached prefixes they lock."""
        return self.max_total_num_tokens - self._kv_available()
