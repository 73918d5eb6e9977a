"""`LoRAMemoryPool`: the device-side slots that hold the adapters a batch uses.

Per target module and layer:  A [slots, c*R, in]   B [slots, out, R]   (c slices, R = max rank).
The buffers are allocated once, here, and never reallocated or resized: captured CUDA graphs hold
their addresses, and the layer wrappers hold views of them. Adapters move in and out by copying
into a slot in place.

An adapter of rank r <= R sits in the compact prefix of its slot: A rows [k*r, (k+1)*r) hold slice
k, B columns [0, r) hold its expand weights. The whole slot is zeroed before a copy, so nothing of a
previous occupant survives (modules the new adapter lacks stay zero). The base model (uid None)
takes a slot like an adapter, with rank 0 and zero A, so base requests of a mixed batch run the
same kernels and add nothing.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Iterable, Optional

import torch

from sglang.srt.lora.eviction_policy import get_eviction_policy
from sglang.srt.lora.lora_config import LoRAConfig, get_stacked_multiply

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
        self.num_slots = max_loras_per_batch
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

        self.slot_to_uid: list[object] = [EMPTY] * self.num_slots  # uid (str | None) or EMPTY
        self.uid_to_slot: dict[Optional[str], int] = {}
        # Rank and scaling of each slot's occupant (0 for EMPTY and the base model).
        self.slot_ranks: list[int] = [0] * self.num_slots
        self.slot_scalings: list[float] = [0.0] * self.num_slots
        # Counters for /get_server_info: adapter copies into a slot, and evictions to make room.
        self.num_adapter_loads = 0
        self.num_evictions = 0

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
        """Make every uid of the batch resident, evicting others (never current or pinned ones)."""
        if len(cur_uids) > self.num_slots:
            raise ValueError(
                f"A batch uses {len(cur_uids)} distinct adapters (base included) but the LoRA pool has "
                f"{self.num_slots} slots (--max-loras-per-batch); the scheduler must not admit it"
            )
        for uid in cur_uids:
            if uid is not None and uid not in adapters:
                raise ValueError(f"LoRA adapter id {uid!r} is not loaded")
        pinned = set(pinned_uids)
        # Sorted only so that policy order and slot assignment are reproducible (None first).
        ordered = sorted(cur_uids, key=lambda u: (u is not None, u or ""))
        for uid in ordered:
            self.eviction_policy.mark_used(uid)
        for uid in ordered:
            if uid in self.uid_to_slot:
                continue
            slot = self._free_slot(cur_uids, pinned)
            self._load(uid, slot, None if uid is None else adapters[uid])

    def _free_slot(self, cur_uids: set[Optional[str]], pinned: set[str]) -> int:
        for slot, occupant in enumerate(self.slot_to_uid):
            if occupant is EMPTY:
                return slot
        candidates = [u for u in self.uid_to_slot if u not in cur_uids and (u is None or u not in pinned)]
        if not candidates:
            raise ValueError(
                f"No LoRA pool slot can be freed: all {self.num_slots} slots hold adapters of the current "
                "batch or pinned adapters (the scheduler's admission must prevent this)"
            )
        victim = self.eviction_policy.select_victim(candidates)
        slot = self.uid_to_slot[victim]
        logger.debug("LoRA pool: evicting %r from slot %d", victim, slot)
        self.free(victim)
        self.num_evictions += 1
        return slot

    def free(self, uid: Optional[str]) -> None:
        """Forget a resident uid (unload or eviction). Its slot becomes EMPTY; nothing moves."""
        slot = self.uid_to_slot.pop(uid, None)
        self.eviction_policy.remove(uid)
        if slot is None:
            return
        self.slot_to_uid[slot] = EMPTY
        self.slot_ranks[slot] = 0
        self.slot_scalings[slot] = 0.0

    @torch.no_grad()
    def _load(self, uid: Optional[str], slot: int, adapter: Optional["LoRAAdapter"]) -> None:
        assert self.slot_to_uid[slot] is EMPTY, "loading into an occupied slot"
        for module in self.target_modules:
            for layer in range(self.shapes.num_layers):
                a_slot = self.A_buffer[module][layer][slot]
                b_slot = self.B_buffer[module][layer][slot]
                # Zero first: the slot may hold an evicted adapter of another rank or other modules.
                a_slot.zero_()
                b_slot.zero_()
                if adapter is None:
                    continue
                weights = adapter.layers[layer].get(module)
                if weights is None:
                    continue
                a, b = weights
                r = adapter.rank
                c = get_stacked_multiply(module)
                fits = a.shape == (c * r, a_slot.shape[1]) and b.shape == (b_slot.shape[0], r)
                assert fits, f"{module} layer {layer}: shapes {tuple(a.shape)}, {tuple(b.shape)} do not fit the pool"
                a_slot[: c * r].copy_(a, non_blocking=True)
                b_slot[:, :r].copy_(b, non_blocking=True)
        self.slot_to_uid[slot] = uid
        self.uid_to_slot[uid] = slot
        self.slot_ranks[slot] = 0 if adapter is None else adapter.rank
        self.slot_scalings[slot] = 0.0 if adapter is None else float(adapter.scaling)
        self.num_adapter_loads += adapter is not None

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
        if any(r > self.max_lora_rank for r in self.slot_ranks):
            problems.append(f"slot ranks {self.slot_ranks} exceed the pool rank {self.max_lora_rank}")
        return problems
