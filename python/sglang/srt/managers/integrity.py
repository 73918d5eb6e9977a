"""Idle-time integrity checks of both processes (reported by /get_server_info).

Scheduler (child process), whenever it becomes idle: every KV slot is free, cached (evictable or
protected by a running request's lock) or owned by a live request (free + cached + used = total,
no slot free twice, free and cached at once, or cached twice), the prefix cache's tree agrees with
its counters and holds no lock once idle, the same accounting for request rows, no finished
request still holds KV, no request is tracked while nothing waits or runs, and the LoRA pool's
slot maps agree both ways with the base slot at rank 0 (`LoRAManager.integrity_report()`), and
under tensor parallelism every rank's scheduler state matches rank 0's (a collective: ranks check
together).
Tokenizer manager (main process), whenever its last request ends: no request state is left over
and the adapter registry holds no in-flight reference.

A problem is a (kind, message) pair. Each kind is logged at ERROR once while it persists (a leak
that grows would otherwise log every turn), and again if it comes back after a clean check.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Iterable

import torch

if TYPE_CHECKING:
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

Problem = tuple[str, str]  # (kind, message)


class IntegrityLog:
    """The latest check's result, plus the ERROR-once-per-distinct-problem logging."""

    def __init__(self, logger: logging.Logger, what: str) -> None:
        self.logger = logger
        self.what = what
        self.runs = 0
        self.failures = 0
        self.active: set[str] = set()  # kinds logged and not yet cleared
        self.last: dict[str, Any] = {}

    def record(self, problems: Iterable[Problem], counts: dict[str, Any]) -> dict[str, Any]:
        problems = list(problems)
        self.runs += 1
        kinds = {kind for kind, _ in problems}
        for kind, message in problems:
            if kind not in self.active:
                self.logger.error("%s integrity check failed [%s]: %s", self.what, kind, message)
        self.active = kinds
        if problems:
            self.failures += 1
        self.last = {
            "ok": not problems,
            "time": time.time(),
            "runs": self.runs,
            "failed_runs": self.failures,
            "problems": [f"[{kind}] {message}" for kind, message in problems],
            **counts,
        }
        return self.last


def _duplicates(values: list[int]) -> list[int]:
    seen: set[int] = set()
    dup: set[int] = set()
    for v in values:
        (dup if v in seen else seen).add(v)
    return sorted(dup)


def scheduler_problems(s: "Scheduler") -> tuple[list[Problem], dict[str, Any]]:
    """Check the scheduler's bookkeeping against its pools (between turns: nothing is mid-flight)."""
    problems: list[Problem] = []
    holders = s._holders()
    idle = not (s.waiting or s.running or s.chunked_req)

    free = s.allocator.free_slots  # int64 on the host; vectorised, as it may hold ~10^6 slots
    kv_total = s.max_total_num_tokens
    kv_free, kv_used = int(free.numel()), sum(r.kv_len - r.cache_len for r in holders)
    cache = s.prefix_cache
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

    free_rows = list(s.req_to_token_pool.free_slots)
    used_rows = [r.req_pool_idx for r in holders if r.req_pool_idx is not None]
    rows_free, rows_used = len(free_rows), len(used_rows)
    if rows_free + rows_used != s.total_rows:
        problems.append(("row_accounting", f"request rows: {rows_free} free + {rows_used} used != "
                                           f"{s.total_rows} total"))
    shared = _duplicates(free_rows + used_rows)
    if shared:
        problems.append(("row_ownership", f"request rows {shared[:8]} are free twice or free and in use"))

    for req in holders + s.waiting:
        if req.finished:
            problems.append(("finished_holds_kv" if req.req_pool_idx is not None else "finished_queued",
                             f"finished request {req.rid!r} is still queued or running ({req!r})"))
    for req in s.waiting:
        if req.req_pool_idx is not None or req.kv_len:
            problems.append(("waiting_holds_kv", f"waiting request {req.rid!r} holds KV ({req!r})"))
    tracked = set(map(id, holders + s.waiting))
    orphans = [rid for rid, req in s.rid_to_req.items() if id(req) not in tracked]
    for rid in orphans:
        req = s.rid_to_req[rid]
        if req.req_pool_idx is not None:  # nobody will ever release it
            problems.append(("orphan_holds_kv", f"request {rid!r}, neither queued nor running, holds KV ({req!r})"))
    if orphans:
        problems.append(("orphaned_requests", f"{len(orphans)} request(s) neither queued nor running: "
                                              f"{orphans[:5]}"))

    counts: dict[str, Any] = {
        "idle": idle, "kv_free": kv_free, "kv_used": kv_used, "kv_total": kv_total, "kv_cached": kv_cached,
        "kv_evictable": tree.evictable_size if tree is not None else 0,
        "kv_protected": tree.protected_size if tree is not None else 0,
        "rows_free": rows_free, "rows_used": rows_used, "rows_total": s.total_rows,
        "num_requests": len(s.rid_to_req),
    }
    lora = s.model_runner.lora_manager
    if lora is not None:
        report = lora.integrity_report()
        problems.extend(("lora_pool", p) for p in report.problems)
        counts["lora_ok"] = report.ok
        counts["lora_resident_slots"] = len(report.resident)
    if s.tp_group.size > 1:
        lockstep = lockstep_problems(s.tp_group.all_gather_object(lockstep_digest(s, counts)))
        problems.extend(lockstep)
        counts["tp_ranks_agree"] = not lockstep
    return problems, counts


def lockstep_digest(s: "Scheduler", counts: dict[str, Any]) -> dict[str, Any]:
    """What every tensor-parallel rank's scheduler must agree on (they all make the same decisions
    on the same messages, DESIGN §11)."""
    lora = s.model_runner.lora_manager
    return {
        "arrivals": s.arrivals, "finished": s.stats["num_finished"], "decode_steps": s.stats["decode_steps"],
        "waiting": [r.rid for r in s.waiting], "running": [r.rid for r in s._holders()],
        "kv_free": counts["kv_free"], "rows_free": counts["rows_free"],
        "lora_slots": None if lora is None else [repr(uid) for uid in lora.pool.slot_to_uid],
    }


def lockstep_problems(digests: list[dict[str, Any]]) -> list[Problem]:
    """One problem per rank whose digest differs from rank 0's (naming the differing fields)."""
    problems: list[Problem] = []
    for rank, digest in enumerate(digests[1:], start=1):
        diff = {k: (digests[0].get(k), v) for k, v in digest.items() if digests[0].get(k) != v}
        if diff:
            problems.append(("tp_lockstep", f"TP rank {rank} disagrees with rank 0 on "
                                            + ", ".join(f"{k} (rank 0: {a!r}, rank {rank}: {b!r})"
                                                        for k, (a, b) in diff.items())))
    return problems


def tokenizer_problems(tm: "TokenizerManager") -> tuple[list[Problem], dict[str, Any]]:
    """The main process's bookkeeping; only meaningful when no request is in progress."""
    problems: list[Problem] = []
    idle = tm.num_active_requests == 0
    in_flight = tm.lora_registry.num_in_flight() if tm.lora_registry is not None else 0
    if idle and tm.rid_to_state:
        rids = sorted(tm.rid_to_state)
        problems.append(("orphaned_states", f"{len(rids)} request state(s) left with no request in "
                                            f"progress: {rids[:5]}"))
    if idle and in_flight:
        held = {name: tm.lora_registry.num_in_flight(ref.lora_id)
                for name, ref in tm.lora_registry.get_all().items()}
        problems.append(("registry_refs", f"the LoRA registry holds {in_flight} in-flight reference(s) "
                                          f"with no request in progress ({held})"))
    counts = {"idle": idle, "active_requests": tm.num_active_requests, "request_states": len(tm.rid_to_state),
              "lora_in_flight_refs": in_flight}
    return problems, counts
