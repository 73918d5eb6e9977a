"""The scheduler's idle-time integrity check (a mixin of `Scheduler`; what it checks and how
problems are logged: managers/integrity.py)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from sglang.srt.managers.integrity import Problem, duplicates, lockstep_problems

# The scheduler's own logger: these mixins are parts of the Scheduler, and operators filter its
# log lines ("Prefill batch, ...") by that name.
logger = logging.getLogger("sglang.srt.managers.scheduler")


class SchedulerIntegrityMixin:
    """Reads the Scheduler's pools, queues, prefix cache, LoRA manager and TP group; writes
    `last_integrity_check` (reported by /get_server_info)."""

    def check_integrity(self) -> dict[str, Any]:
        """Run the check; ERROR-logs new problems (IntegrityLog)."""
        problems, counts = self.integrity_problems()
        self.last_integrity_check = self.integrity_log.record(problems, counts)
        return self.last_integrity_check

    def _recheck_if_idle(self) -> None:
        """Keep the reported idle-time check current after memory moved while idle."""
        if self.is_idle():
            self.check_integrity()

    def integrity_problems(self) -> tuple[list[Problem], dict[str, Any]]:
        """The bookkeeping against the pools (between turns: nothing is mid-flight)."""
        problems: list[Problem] = []
        holders = self._holders()
        idle = not (self.waiting or self.running or self.chunked_req or self.grammar_queue)

        free = self.allocator.free_slots  # int64 on the host; vectorised, as it may hold ~10^6 slots
        kv_total = self.max_total_num_tokens
        kv_free, kv_used = int(free.numel()), sum(r.kv_len - r.cache_len for r in holders)
        cache = self.prefix_cache
        tree = cache.tree if cache is not None else None
        kv_cached = tree.total_size if tree is not None else 0
        if kv_free + kv_cached + kv_used != kv_total:
            problems.append(("kv_accounting", f"KV slots: {kv_free} free + {kv_cached} cached + {kv_used} used by "
                                              f"requests != {kv_total} total "
                                              f"({kv_total - kv_free - kv_cached - kv_used:+d} unaccounted)"))
        owned = torch.cat((free, tree.all_slots())) if tree is not None else free
        if owned.numel():
            if bool(((owned < 1) | (owned > kv_total)).any()):
                problems.append(("kv_free_list", f"KV free list or cache holds slots outside 1..{kv_total}"))
            else:
                dup = torch.nonzero(torch.bincount(owned, minlength=kv_total + 1) > 1).flatten()[:8].tolist()
                if dup:
                    problems.append(("kv_free_list", f"KV slots {dup} are duplicated: free twice, cached twice, "
                                                     "or free and cached at once"))
        if tree is not None:
            problems.extend(("prefix_cache", p) for p in tree.problems())
            if idle and tree.protected_size:
                problems.append(("prefix_cache", f"{tree.protected_size} cached tokens are still locked with "
                                                  "no request running"))
            for req in holders:
                if req.cache_len and (req.cache_node is None or req.cache_node.lock_ref <= 0):
                    problems.append(("prefix_cache", f"request {req.rid!r} uses {req.cache_len} cached tokens "
                                                      "without a lock on them"))

        pool = self.req_to_token_pool
        if pool.host is not pool.req_to_token:  # the host twin the scheduler reads slots from
            for req in holders:
                if req.req_pool_idx is not None and req.kv_len and not torch.equal(
                        pool.host[req.req_pool_idx, : req.kv_len],
                        pool.req_to_token[req.req_pool_idx, : req.kv_len].cpu()):
                    problems.append(("req_to_token_twin", f"request {req.rid!r}: the host copy of its KV slots "
                                                          "differs from the device table"))
        free_rows = list(pool.free_slots)
        used_rows = [r.req_pool_idx for r in holders if r.req_pool_idx is not None]
        rows_free, rows_used = len(free_rows), len(used_rows)
        if rows_free + rows_used != self.total_rows:
            problems.append(("row_accounting", f"request rows: {rows_free} free + {rows_used} used != "
                                               f"{self.total_rows} total"))
        shared = duplicates(free_rows + used_rows)
        if shared:
            problems.append(("row_ownership", f"request rows {shared[:8]} are free twice or free and in use"))

        for req in holders + self.waiting + self.grammar_queue:
            if req.finished:
                problems.append(("finished_holds_kv" if req.req_pool_idx is not None else "finished_queued",
                                 f"finished request {req.rid!r} is still queued or running ({req!r})"))
        for req in self.waiting:
            if req.req_pool_idx is not None or req.kv_len:
                problems.append(("waiting_holds_kv", f"waiting request {req.rid!r} holds KV ({req!r})"))
        tracked = set(map(id, holders + self.waiting + self.grammar_queue))
        orphans = [rid for rid, req in self.rid_to_req.items() if id(req) not in tracked]
        for rid in orphans:
            req = self.rid_to_req[rid]
            if req.req_pool_idx is not None:  # nobody will ever release it
                problems.append(("orphan_holds_kv",
                                 f"request {rid!r}, neither queued nor running, holds KV ({req!r})"))
        if orphans:
            problems.append(("orphaned_requests", f"{len(orphans)} request(s) neither queued nor running: "
                                                  f"{orphans[:5]}"))

        counts_table = self.logit_ctx.token_counts_if_any
        counts_rows_used = 0
        if counts_table is not None:
            # Penalised requests own a row of the token-count table until they finish (a retracted
            # one keeps it while it waits); any other row in use is a leak.
            held = [r.counts_row for r in holders + self.waiting if r.counts_row is not None]
            counts_rows_used = counts_table.rows_in_use
            if counts_rows_used != len(held) or duplicates(held + counts_table.free_rows):
                problems.append(("token_count_rows", f"penalty token-count rows: {counts_rows_used} in use, "
                                                     f"{len(held)} held by queued or running requests"))
        grammar_problems, grammar_counts = self.grammar_problems(holders + self.waiting + self.grammar_queue, idle)
        problems.extend(grammar_problems)
        counts: dict[str, Any] = {
            "idle": idle, "kv_free": kv_free, "kv_used": kv_used, "kv_total": kv_total, "kv_cached": kv_cached,
            "kv_evictable": tree.evictable_size if tree is not None else 0,
            "kv_protected": tree.protected_size if tree is not None else 0,
            "rows_free": rows_free, "rows_used": rows_used, "rows_total": self.total_rows,
            "num_requests": len(self.rid_to_req), "token_count_rows_used": counts_rows_used,
            **grammar_counts,
        }
        lora = self.model_runner.lora_manager
        if lora is not None:
            report = lora.integrity_report()
            problems.extend(("lora_pool", p) for p in report.problems)
            counts["lora_ok"] = report.ok
            counts["lora_resident_slots"] = len(report.resident)
        if self.tp_group.size > 1:
            lockstep = lockstep_problems(self.tp_group.all_gather_object(self.lockstep_digest(counts)))
            problems.extend(lockstep)
            counts["tp_ranks_agree"] = not lockstep
        return problems, counts

    def lockstep_digest(self, counts: dict[str, Any]) -> dict[str, Any]:
        """What every tensor-parallel rank's scheduler must agree on (they all make the same
        decisions on the same messages, DESIGN §11)."""
        lora = self.model_runner.lora_manager
        return {
            "arrivals": self.arrivals, "finished": self.stats["num_finished"],
            "decode_steps": self.stats["decode_steps"],
            "waiting": [r.rid for r in self.waiting], "running": [r.rid for r in self._holders()],
            "grammar_queue": [r.rid for r in self.grammar_queue], "grammar_matchers": self.grammar_matchers,
            "kv_free": counts["kv_free"], "rows_free": counts["rows_free"],
            "lora_slots": None if lora is None else [repr(lora_id) for lora_id in lora.pool.slot_to_lora_id],
        }
