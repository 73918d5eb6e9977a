"""Admission: which waiting requests join the next prefill batch (DESIGN §3 step 3).

FCFS with these limits, all checked before a request is admitted, never by failing it:
  * request slots: `--max-running-requests` and free ReqToTokenPool rows;
  * tokens: `--max-prefill-tokens` per batch, prompts longer than `--chunked-prefill-size` are
    split into chunks (the partly prefilled request is the "chunked" one and goes first next turn);
  * KV: the batch's new tokens plus a *reservation* for the tokens running requests will still
    decode (`new_token_ratio` x their remaining budget; the ratio rises after a retraction and
    decays while decoding goes well);
  * LoRA: the distinct adapters of everything running, chunked and admitted must fit
    `validate_lora_batch`, with a bounded wait for a request whose adapter does not fit
    (`LoRAAdmission`); the scheduler's `GroupedLoRAAdmission` also orders the waiting requests by
    adapter and rotates adapters through the slots, to keep the running batch full.
  * prefix cache (optional): a request counts only its uncached suffix, plus the cached tokens its
    lock takes out of the evictable pool; a request whose next tokens a request of this batch is
    about to compute (the same prompt, arriving together) waits a turn and reuses them instead.
A request blocked by KV stops admission (later requests must not overtake it); a request blocked
only by its adapter, or deferred for the cache, is skipped, so other requests keep flowing.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Protocol

from sglang.srt.managers.req import Req

# A single request's reservation is capped: huge `max_new_tokens` budgets rarely run out.
RESERVE_CLIP_TOKENS = 4096


def reserved_tokens(req: Req, ratio: float) -> int:
    return math.ceil(min(req.remaining_new_tokens, RESERVE_CLIP_TOKENS) * ratio)


_NOBODY = object()  # no adapter (None is the base model)


class LoRAAdmission:
    """Do the distinct adapters of a batch fit the LoRA memory pool?

    `validate` is `lora_manager.validate_lora_batch(set_of_ids) -> bool`, or None when LoRA is off
    (every request fits). "Active" adapters are those of every running and chunked request, base
    (None) included: a prefill batch is admitted only if they and its own adapters fit together.

    Anti-starvation: once a waiting request has been turned away for `max_wait_turns` turns, the
    oldest such request (the target) gets priority, and its requests are considered first:
      * if its adapter fits next to the active ones now, it is admitted along with requests of
        already-active adapters, and no *new* adapter may take the free slot first;
      * otherwise the slots are drained: no request is admitted except ones for its adapter, so the
        running requests finish (each within its bounded `max_new_tokens`), their adapters leave
        the active set, and it fits. Without the drain, a steady stream of requests for adapters
        that are already running would keep every slot busy and the request would wait forever.
    Either way requests that take no slot the target could get (the base model's, and a pinned
    adapter's: `needs_slot` False) are still admitted: holding them back would not free a slot.

    `needs_slot(lora_id)` tells whether an adapter competes for the pool's slots (default: every
    adapter but the base model; the scheduler's also exempts pinned ones, whose slots are theirs).
    """

    def __init__(self, validate: Optional[Callable[[set], bool]], max_wait_turns: int,
                 needs_slot: Optional[Callable[[Optional[str]], bool]] = None) -> None:
        self.validate = validate
        self.max_wait_turns = max_wait_turns
        self.needs_slot = needs_slot if needs_slot is not None else (lambda lora_id: lora_id is not None)
        self.active: set[Optional[str]] = set()
        self.allowed: Optional[set[Optional[str]]] = None
        self.target: object = _NOBODY  # the starving request's adapter, while one starves

    @property
    def enabled(self) -> bool:
        return self.validate is not None

    def begin(self, active: Iterable[Optional[str]], waiting: Iterable[Req]) -> None:
        self.active = set(active)
        self.allowed = None
        self.target = _NOBODY
        if not self.enabled:
            return
        starving = [r for r in waiting if r.lora_wait_turns >= self.max_wait_turns]
        if starving:
            target = self.target = min(starving, key=lambda r: r.arrival).lora_id
            if target in self.active or self.validate(self.active | {target}):
                self.allowed = self.active | {target}
            else:
                self.allowed = {target}  # drain until it fits

    def fits(self, lora_id: Optional[str]) -> bool:
        if not self.enabled:
            return True
        if self.allowed is not None and lora_id not in self.allowed and self.needs_slot(lora_id):
            return False
        if lora_id in self.active:
            return True
        return bool(self.validate(self.active | {lora_id}))

    def add(self, lora_id: Optional[str]) -> None:
        self.active.add(lora_id)


class GroupedLoRAAdmission(LoRAAdmission):
    """LoRA admission that keeps the running batch full when requests want more adapters than
    there are slots (what the scheduler uses; LoRAAdmission alone is the plain slot check).

      * Order (`order`): requests of active adapters and of the base model first (they need no
        new slot), FCFS; then the others grouped by adapter, the adapter in most demand first, so
        free slots go where most requests wait. Demand = waiting requests plus the turns they have
        waited, so an adapter with one old request still rises.
      * Rotation: when an adapter that requests wait for does not fit, the active adapter in least
        demand (then with the least decode work left) stops admitting new requests, if it is in
        less demand than the waiting one. It drains completely (a swap half done would keep both
        waiting), then its slot goes to the adapter in most demand. One adapter retires at a time.
        Without this, adapters that keep getting requests hold their slots for good, and the
        batch shrinks to their requests.
      * The wait-turns rule is LoRAAdmission's, unchanged: while a request starves it overrides
        rotation.
    `wanted_adapters` gives the order in which adapters will want slots (for prefetching them).
    """

    def __init__(self, validate: Optional[Callable[[set], bool]], max_wait_turns: int,
                 needs_slot: Optional[Callable[[Optional[str]], bool]] = None) -> None:
        super().__init__(validate, max_wait_turns, needs_slot)
        self.retiring: object = _NOBODY
        self._demand: dict[Optional[str], float] = {}

    @staticmethod
    def demand(waiting: Iterable[Req]) -> dict[Optional[str], float]:
        out: dict[Optional[str], float] = defaultdict(float)
        for r in waiting:
            out[r.lora_id] += 1 + r.lora_wait_turns
        return out

    def begin(self, active: Iterable[Optional[str]], waiting: Iterable[Req], running: Iterable[Req] = ()) -> None:
        waiting = list(waiting)
        super().begin(active, waiting)
        self._demand = self.demand(waiting) if self.enabled else {}
        if not self.enabled or self.allowed is not None:
            self.retiring = _NOBODY  # a request starves: LoRAAdmission's drain decides
            return
        if self.retiring not in self.active:
            self.retiring = _NOBODY  # it has drained: its slot is free for the adapter that waited
        blocked = [u for u in self._demand if u not in self.active and not self.validate(self.active | {u})]
        if blocked and self.retiring is _NOBODY:
            self.retiring = self._pick_retiring(blocked, list(running))

    def _pick_retiring(self, blocked: list[Optional[str]], running: list[Req]) -> object:
        demand = self._demand
        wanted = max(blocked, key=lambda u: (demand[u], u or ""))
        work: dict[Optional[str], int] = defaultdict(int)
        for r in running:
            work[r.lora_id] += r.remaining_new_tokens
        # Only an adapter whose slot would take `wanted` (not a pinned one, not the base model).
        victims = [v for v in self.active if v is not None and self.validate((self.active - {v}) | {wanted})]
        if not victims:
            return _NOBODY
        victim = min(victims, key=lambda v: (demand.get(v, 0.0), work[v], v))
        return victim if demand.get(victim, 0.0) < demand[wanted] else _NOBODY

    def fits(self, lora_id: Optional[str]) -> bool:
        if self.enabled and lora_id is not None and lora_id == self.retiring:
            return False
        return super().fits(lora_id)

    def order(self, waiting: list[Req]) -> list[Req]:
        """`waiting` (FCFS, or longest prefix first) in the order admission should consider it (see
        the class docstring); within a group the incoming order is kept."""
        if not self.enabled:
            return waiting
        demand = self._demand

        position = {id(r): i for i, r in enumerate(waiting)}  # the incoming order breaks ties

        def key(r: Req) -> tuple:
            if r.lora_id == self.target:  # a request starves: its adapter's requests go first
                return (-1, 0.0, "", position[id(r)])
            if r.lora_id is None or r.lora_id in self.active:
                return (0, 0.0, "", position[id(r)])
            return (1, -demand[r.lora_id], r.lora_id, position[id(r)])

        return sorted(waiting, key=key)

    def wanted_adapters(self, waiting: Iterable[Req], active: Iterable[Optional[str]]) -> list[str]:
        """Adapters that waiting requests want and that are not active, most wanted first; a
        starving request's adapter before all (the drain's first free slot is for it, so its copy
        should be the one under way)."""
        demand = self.demand(waiting)
        active = set(active)
        return sorted((u for u in demand if u is not None and u not in active),
                      key=lambda u: (u != self.target, -demand[u], u))


# `--schedule-policy lpm` ranks at most this many waiting requests by their cached prefix; a longer
# queue keeps FCFS (the ranking walks every prompt through the tree each turn), as SGLang does.
LPM_MAX_WAITING = 128


def longest_prefix_first(waiting: list[Req], cached_len: Callable[[Req], int]) -> list[Req]:
    """`--schedule-policy lpm`: the requests with the most cached tokens first, FCFS among equals.
    Requests of a shared prompt then run while its KV is still cached, instead of in arrival
    order, which may evict it between them."""
    if len(waiting) > LPM_MAX_WAITING:
        return waiting
    lengths = {id(r): cached_len(r) for r in waiting}
    return sorted(waiting, key=lambda r: -lengths[id(r)])  # stable: FCFS among equal hits


class PrefixAdmission(Protocol):
    """The prefix cache as admission sees it (managers/prefix_cache.py). A hit has `length`
    (cached tokens reused) and `cost` (evictable tokens its lock would protect)."""

    def match(self, req: Req) -> Any: ...

    def defer(self, req: Req, hit: Any) -> bool: ...

    def admit(self, req: Req, hit: Any) -> None: ...


@dataclass
class PrefillBudget:
    kv_free: int  # free KV slots (with a prefix cache: free + evictable)
    rows_free: int  # free ReqToTokenPool rows
    max_new_reqs: int  # requests that may still start (max running minus running and chunked)
    max_prefill_tokens: int
    chunk_size: Optional[int]  # None: chunking off
    new_token_ratio: float


@dataclass
class PrefillPlan:
    reqs: list[Req] = field(default_factory=list)  # each with `extend_len` set for this pass
    chunked: Optional[Req] = None  # the request whose prefill continues next turn
    lora_blocked: list[Req] = field(default_factory=list)


def plan_prefill(
    waiting: list[Req],
    chunked: Optional[Req],
    running: list[Req],
    budget: PrefillBudget,
    lora: LoRAAdmission,
    prefix: Optional[PrefixAdmission] = None,
) -> PrefillPlan:
    """Pick the next prefill batch. `waiting` is in the order admission considers it (FCFS, or
    `GroupedLoRAAdmission.order`); nothing is mutated except the chosen requests' `extend_len` (and
    their cached prefix, through `prefix.admit`) and the skipped ones' `lora_wait_turns`."""
    plan = PrefillPlan()
    ratio = budget.new_token_ratio
    kv_free = budget.kv_free
    reserve = sum(reserved_tokens(r, ratio) for r in running)
    tokens_left = budget.max_prefill_tokens
    chunk_left = budget.chunk_size if budget.chunk_size is not None else math.inf
    nothing_running = not running

    def next_piece(req: Req, room: float) -> int:
        return int(min(req.remaining_prefill, chunk_left, room))

    if chunked is not None:
        # Already holds a row and KV: it continues first, as far as the budgets allow.
        reserve += reserved_tokens(chunked, ratio)
        room = kv_free - (0 if nothing_running else reserve - reserved_tokens(chunked, ratio))
        piece = next_piece(chunked, min(room, tokens_left))
        if piece <= 0:
            return plan
        chunked.extend_len = piece
        plan.reqs.append(chunked)
        kv_free -= piece
        tokens_left -= piece
        chunk_left -= piece
        if piece < chunked.remaining_prefill:
            plan.chunked = chunked
            return plan
        nothing_running = False

    rows_left = min(budget.rows_free, budget.max_new_reqs)
    examined = 0  # waiting[:examined] went through the adapter check this turn
    for i, req in enumerate(waiting):
        if rows_left <= 0 or tokens_left <= 0 or chunk_left <= 0:
            break
        examined = i + 1
        if not lora.fits(req.lora_id):
            req.lora_wait_turns += 1
            plan.lora_blocked.append(req)
            continue
        hit = prefix.match(req) if prefix is not None else None
        if hit is not None and prefix.defer(req, hit):
            continue
        cost = hit.cost if hit is not None else 0
        need = req.remaining_prefill - (hit.length if hit is not None else 0)
        own_reserve = reserved_tokens(req, ratio)
        alone = nothing_running and not plan.reqs
        if alone:
            # Nothing else can free KV for it: admit whenever its prompt fits (the tokenizer
            # manager guarantees prompt + max_new_tokens fits the pool).
            room = kv_free - cost
        else:
            room = kv_free - reserve - own_reserve - cost
        if need > chunk_left:
            # Chunk it: this request ends the batch and continues next turn.
            piece = int(min(chunk_left, tokens_left, room))
            if piece <= 0:
                break
            if hit is not None:
                prefix.admit(req, hit)
            req.extend_len = piece
            plan.reqs.append(req)
            plan.chunked = req
            lora.add(req.lora_id)
            break
        if need > room or (need > tokens_left and plan.reqs):
            break  # FCFS: nobody overtakes a request that waits for KV or for the next batch
        if hit is not None:
            prefix.admit(req, hit)
        req.extend_len = need
        plan.reqs.append(req)
        lora.add(req.lora_id)
        kv_free -= need + cost
        reserve += own_reserve
        tokens_left -= need
        chunk_left -= need
        rows_left -= 1
    # A request the loop did not reach, whose adapter does not fit either, waited for its adapter
    # this turn all the same. Counted only where it was reached, it never starved while requests
    # that need no new slot (the base model's, running adapters') kept the rows or KV full: the
    # drain never began and it waited for good. One check per adapter, not per request: this runs
    # every turn, over the whole queue.
    rest = waiting[examined:]
    if lora.enabled and rest:
        blocked = {u for u in {r.lora_id for r in rest} if not lora.fits(u)}
        if blocked:
            for req in rest:
                if req.lora_id in blocked:
                    req.lora_wait_turns += 1
    return plan
