"""Idle-time integrity checks of both processes (reported by /get_server_info).

Scheduler (child process), whenever it becomes idle: every KV slot is free, cached (evictable or
protected by a running request's lock) or owned by a live request (free + cached + used = total,
no slot free twice, free and cached at once, or cached twice), the prefix cache's tree agrees with
its counters and holds no lock once idle, the same accounting for request rows, no finished
request still holds KV, no request is tracked while nothing waits or runs, every live grammar
matcher belongs to a queued or running request and no compile is tracked once idle (constrained
decoding: `SchedulerGrammarMixin.grammar_problems`), and the LoRA pool's
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
from typing import Any, Iterable, Mapping, Optional

from sglang.srt.lora.lora_registry import LoRARegistry

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


def duplicates(values: list[int]) -> list[int]:
    seen: set[int] = set()
    dup: set[int] = set()
    for v in values:
        (dup if v in seen else seen).add(v)
    return sorted(dup)


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


def tokenizer_problems(num_active_requests: int, rid_to_state: Mapping[str, Any],
                       lora_registry: Optional[LoRARegistry]) -> tuple[list[Problem], dict[str, Any]]:
    """The main process's bookkeeping; only meaningful when no request is in progress."""
    problems: list[Problem] = []
    idle = num_active_requests == 0
    in_flight = lora_registry.num_in_flight() if lora_registry is not None else 0
    if idle and rid_to_state:
        rids = sorted(rid_to_state)
        problems.append(("orphaned_states", f"{len(rids)} request state(s) left with no request in "
                                            f"progress: {rids[:5]}"))
    if idle and in_flight:
        held = {name: lora_registry.num_in_flight(ref.lora_id) for name, ref in lora_registry.get_all().items()}
        problems.append(("registry_refs", f"the LoRA registry holds {in_flight} in-flight reference(s) "
                                          f"with no request in progress ({held})"))
    counts = {"idle": idle, "active_requests": num_active_requests, "request_states": len(rid_to_state),
              "lora_in_flight_refs": in_flight}
    return problems, counts
