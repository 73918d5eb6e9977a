"""`LoRAMemoryPool`: the device-side slots that hold the adapters a batch uses.

Per target module and layer:  A [slots, c*R, in]   B [slots, out, R]   (c slices, R = max rank).
The buffers are allocated once, here, and never reallocated or resized: captured CUDA graphs hold
their addresses, and the layer wrappers hold views of them. Adapters move in and out by copying
into a slot in place.

An adapter of rank r <= R sits in the compact prefix of its slot: A rows [k*r, (k+1)*r) hold slice
k, B columns [0, r) hold its expand weights. Whatever a previous occupant wrote outside the new
one's prefix is zeroed, so nothing of it survives (modules the new adapter lacks stay zero).

Slots: `max_loras_per_batch` adapter slots, plus one more, the last, that holds the base model
(uid None) for good: rank 0 and all zero, so base requests of a mixed batch run the same kernels
and add nothing. The base model therefore never takes, nor waits for, an adapter slot.

Copies into a slot go through the `SlotLoader` (a side stream on CUDA); `wait_for` makes the
forward's stream wait for the slots a batch uses, and `prefetch` loads adapters that waiting
requests will need while the current forward runs.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Iterable, Optional

import torch

from sglang.srt.lora.eviction_policy import get_eviction_policy
from sglang.srt.lora.lora_config import LoRAConfig, get_stacked_multiply
from sglang.srt.lora.slot_loader import SlotLoader

if TYPE_CHECKING:
    from sglang.srt.lora.lora import LoRAAdapter, LoRAModelShapes

logger = logging.getLogger(__name__)


class _EmptySlot:
    """Marks a free slot. Distinct from None, which is a valid uid (the base model)."""

    _instance: Optional["_EmptySlot"] = None

    def __new__(cls) -> "_EmptySlot":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "EMPTY"


EMPTY = _EmptySlot()


class LoRAMemoryPool:
    def __init__(
        self,
        shapes: "LoRAModelShapes",
        target_modules: Iterable[str],
        max_loras_per_batch: int,
        max_lora_rank: int,
        dtype: torch.dtype,
        device: torch.device | str,
        eviction_policy: str = "lru",
    ) -> None:
        if max_loras_per_batch < 1:
            raise ValueError("--max-loras-per-batch must be >= 1")
        if max_lora_rank < 1:
            raise ValueError("--max-lora-rank must be >= 1")
        self.shapes = shapes
        self.target_modules: list[str] = sorted(set(target_modules))
        missing = [m for m in self.target_modules if m not in shapes.modules]
        if missing:
            raise ValueError(f"The base model has no module(s) {missing} to carry LoRA on")
        self.num_adapter_slots = max_loras_per_batch
        self.base_slot = max_loras_per_batch
        self.num_slots = max_loras_per_batch + 1  # buffer slots, the base model's included
        self.max_lora_rank = max_lora_rank
        self.dtype = dtype
        self.device = torch.device(device)
        self.eviction_policy = get_eviction_policy(eviction_policy)

        # A_buffer[module][layer]: [slots, c*R, in]; B_buffer[module][layer]: [slots, out, R].
        # Zero-initialised so no slot ever holds non-finite garbage a kernel could touch.
        self.A_buffer: dict[str, list[torch.Tensor]] = {}
        self.B_buffer: dict[str, list[torch.Tensor]] = {}
        R = max_lora_rank
        for module in self.target_modules:
            shape = shapes.modules[module]
            c = get_stacked_multiply(module)
            self.A_buffer[module] = [
                torch.zeros(self.num_slots, c * R, shape.in_dim, dtype=dtype, device=self.device)
                for _ in range(shapes.num_layers)
            ]
            self.B_buffer[module] = [
                torch.zeros(self.num_slots, shape.out_dim, R, dtype=dtype, device=self.device)
                for _ in range(shapes.num_layers)
            ]

        self.slot_to_uid: list[object] = [EMPTY] * self.num_adapter_slots + [None]  # uid (str | None) or EMPTY
        self.uid_to_slot: dict[Optional[str], int] = {None: self.base_slot}
        # Rank and scaling of each slot's occupant (0 for EMPTY and the base model).
        self.slot_ranks: list[int] = [0] * self.num_slots
        self.slot_scalings: list[float] = [0.0] * self.num_slots
        # Per slot and module, the rank whose prefix holds non-zero weights (0: all zero).
        self._written_rank: list[dict[str, int]] = [{} for _ in range(self.num_slots)]
        self.loader = SlotLoader(self.device)
        # Counters for /get_server_info: adapter copies into a slot, evictions to make room, and
        # the copies issued ahead of need (prefetches).
        self.num_adapter_loads = 0
        self.num_evictions = 0
        self.num_prefetches = 0

    # ------------------------------------------------------------------ compatibility
    def incompatibility(self, config: LoRAConfig) -> Optional[str]:
        """Why an adapter cannot live in this pool, or None if it can."""
        if config.r > self.max_lora_rank:
            return (
                f"its rank {config.r} is above the LoRA pool's maximum rank {self.max_lora_rank}; "
                f"restart the server with --max-lora-rank {config.r} (or higher) to serve it"
            )
        outside = sorted(config.normalized_target_modules - set(self.target_modules))
        if outside:
            return (
                f"it targets module(s) {outside} that the LoRA pool does not cover "
                f"(pool: {self.target_modules}); restart the server with --lora-target-modules "
                "including them (or 'all') to serve it"
            )
        return None

    def can_support(self, config: LoRAConfig) -> bool:
        return self.incompatibility(config) is None

    # ------------------------------------------------------------------ residency
    def is_resident(self, uid: Optional[str]) -> bool:
        return uid in self.uid_to_slot

    def get_slot(self, uid: Optional[str]) -> int:
        return self.uid_to_slot[uid]

    def prepare_lora_batch(
        self,
        cur_uids: set[Optional[str]],
        adapters: dict[str, "LoRAAdapter"],
        pinned_uids: Iterable[str] = (),
    ) -> None:
        """Make every uid of the batch resident, evicting others (never current or pinned ones),
        and make the current stream wait until their slots are written."""
        wanted = {u for u in cur_uids if u is not None}
        if len(wanted) > self.num_adapter_slots:
            raise ValueError(
                f"A batch uses {len(wanted)} distinct adapters but the LoRA pool has "
                f"{self.num_adapter_slots} adapter slots (--max-loras-per-batch); the scheduler must not admit it"
            )
        for uid in wanted:
            if uid not in adapters:
                raise ValueError(f"LoRA adapter id {uid!r} is not loaded")
        pinned = set(pinned_uids)
        # Sorted only so that policy order and slot assignment are reproducible.
        ordered = sorted(wanted)
        for uid in ordered:
            self.eviction_policy.mark_used(uid)
        for uid in ordered:
            if uid in self.uid_to_slot:
                continue
            slot = self._free_slot(wanted, pinned)
            self._load(uid, slot, adapters[uid])
        self.loader.wait_for(self.uid_to_slot[u] for u in wanted)

    def prefetch(
        self,
        wanted: list[str],
        adapters: dict[str, "LoRAAdapter"],
        protected: Iterable[Optional[str]],
        pinned_uids: Iterable[str] = (),
    ) -> list[str]:
        """Load adapters that waiting requests will need, most wanted first, into free slots or in
        place of resident adapters that no waiting request wants and that are neither protected
        (the running batch's) nor pinned. The copies overlap the forward in flight; the batch that
        uses them waits for them (`prepare_lora_batch`). Returns the uids loaded."""
        keep = set(protected) | set(pinned_uids) | set(wanted)
        loaded = []
        for uid in wanted:
            if uid in self.uid_to_slot or uid not in adapters:
                continue
            slot = next((s for s in range(self.num_adapter_slots) if self.slot_to_uid[s] is EMPTY), None)
            if slot is None:
                victims = [u for u in self.uid_to_slot if u is not None and u not in keep]
                if not victims:
                    break
                victim = self.eviction_policy.select_victim(victims)
                slot = self.uid_to_slot[victim]
                self.free(victim)
                self.num_evictions += 1
            self._load(uid, slot, adapters[uid])
            self.eviction_policy.mark_used(uid)  # about to be used: not the next victim
            self.num_prefetches += 1
            loaded.append(uid)
        return loaded

    def _free_slot(self, cur_uids: set[Optional[str]], pinned: set[str]) -> int:
        for slot in range(self.num_adapter_slots):
            if self.slot_to_uid[slot] is EMPTY:
                return slot
        candidates = [u for u in self.uid_to_slot if u is not None and u not in cur_uids and u not in pinned]
        if not candidates:
            raise ValueError(
                f"No LoRA pool slot can be freed: all {self.num_adapter_slots} adapter slots hold adapters "
                "of the current batch or pinned adapters (the scheduler's admission must prevent this)"
            )
        victim = self.eviction_policy.select_victim(candidates)
        slot = self.uid_to_slot[victim]
        logger.debug("LoRA pool: evicting %r from slot %d", victim, slot)
        self.free(victim)
        self.num_evictions += 1
        return slot

    def free(self, uid: Optional[str]) -> None:
        """Forget a resident adapter (unload or eviction). Its slot becomes EMPTY; nothing moves.
        The base model's slot is never freed."""
        if uid is None:
            return
        slot = self.uid_to_slot.pop(uid, None)
        self.eviction_policy.remove(uid)
        if slot is None:
            return
        self.slot_to_uid[slot] = EMPTY
        self.slot_ranks[slot] = 0
        self.slot_scalings[slot] = 0.0

    @torch.no_grad()
    def _load(self, uid: str, slot: int, adapter: "LoRAAdapter") -> None:
        assert self.slot_to_uid[slot] is EMPTY and slot != self.base_slot, "loading into an occupied slot"
        r = adapter.rank
        present = adapter.modules
        written = self._written_rank[slot]
        with self.loader.writing(slot):
            for module in self.target_modules:
                c = get_stacked_multiply(module)
                old = written.get(module, 0)
                new = r if module in present else 0
                for layer in range(self.shapes.num_layers):
                    a_slot = self.A_buffer[module][layer][slot]
                    b_slot = self.B_buffer[module][layer][slot]
                    weights = adapter.layers[layer].get(module)
                    if weights is not None:
                        a, b = weights
                        fits = a.shape == (c * r, a_slot.shape[1]) and b.shape == (b_slot.shape[0], r)
                        assert fits, f"{module} layer {layer}: shapes {tuple(a.shape)}, {tuple(b.shape)} do not fit the pool"
                        a_slot[: c * r].copy_(a, non_blocking=True)
                        b_slot[:, :r].copy_(b, non_blocking=True)
                    elif new:
                        # A layer the adapter skips inside a module it has: its prefix must be zero.
                        a_slot[: c * r].zero_()
                        b_slot[:, :r].zero_()
                    if old > new:  # what the previous occupant left beyond the new prefix
                        a_slot[c * new : c * old].zero_()
                        b_slot[:, new:old].zero_()
                written[module] = new
        self.slot_to_uid[slot] = uid
        self.uid_to_slot[uid] = slot
        self.slot_ranks[slot] = r
        self.slot_scalings[slot] = float(adapter.scaling)
        self.num_adapter_loads += 1

    # ------------------------------------------------------------------ checks
    def data_ptrs(self) -> list[int]:
        """Addresses of every buffer (tests assert they never change)."""
        return [t.data_ptr() for m in self.target_modules for t in self.A_buffer[m] + self.B_buffer[m]]

    def integrity_problems(self) -> list[str]:
        problems: list[str] = []
        for uid, slot in self.uid_to_slot.items():
            if (
                not 0 <= slot < self.num_slots
                or self.slot_to_uid[slot] != uid
                or self.slot_to_uid[slot] is EMPTY
            ):
                problems.append(f"uid {uid!r} maps to slot {slot}, which holds {self.slot_to_uid[slot]!r}")
        for slot, uid in enumerate(self.slot_to_uid):
            if uid is EMPTY:
                if self.slot_ranks[slot] != 0:
                    problems.append(f"empty slot {slot} has rank {self.slot_ranks[slot]}")
                continue
            if self.uid_to_slot.get(uid) != slot:
                problems.append(f"slot {slot} holds {uid!r}, which maps to {self.uid_to_slot.get(uid)!r}")
            if uid is None and self.slot_ranks[slot] != 0:
                problems.append(f"base-model slot {slot} has rank {self.slot_ranks[slot]}, expected 0")
        if self.slot_to_uid[self.base_slot] is not None or self.uid_to_slot.get(None) != self.base_slot:
            problems.append(f"the base model does not hold its own slot {self.base_slot}")
        if any(r > self.max_lora_rank for r in self.slot_ranks):
            problems.append(f"slot ranks {self.slot_ranks} exceed the pool rank {self.max_lora_rank}")
        return problems
