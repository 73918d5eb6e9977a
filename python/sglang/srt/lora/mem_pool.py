"""`LoRAMemoryPool`: the device-side slots that hold the adapters a batch uses.

Per target module and layer:  A [slots, c*R, in]   B [slots, out, R]   (c slices, R = max rank).
The buffers are allocated once, here, and never reallocated or resized: captured CUDA graphs hold
their addresses, and the layer wrappers hold views of them. Adapters move in and out by copying
into a slot in place.

An adapter of rank r <= R sits in the compact prefix of its slot: A rows [k*r, (k+1)*r) hold slice
k, B columns [0, r) hold its expand weights. Whatever a previous occupant wrote outside the new
one's prefix is zeroed, so nothing of it survives (modules the new adapter lacks stay zero).

Slots: `max_loras_per_batch` adapter slots, plus one more, the last, that holds the base model
(lora_id None) for good: rank 0 and all zero, so base requests of a mixed batch run the same kernels
and add nothing. The base model therefore never takes, nor waits for, an adapter slot.

Copies into a slot go through the `SlotLoader` (a side stream on CUDA); `wait_for` makes the
forward's stream wait for the slots a batch uses, and `prefetch` loads adapters that waiting
requests will need while the current forward runs.

Folded modules (lora/fold.py): their B lives inside the augmented base weight W_aug [N, K + E] that
the module's one GEMM reads. `fold_base_weight` builds W_aug from the base weight (the manager calls
it for every layer before wrapping), and `B_buffer[module][layer]` is a `SlicedB` over its
block-diagonal columns: indexed and written like a plain [slots, out, R] buffer, so loading is the
same for both layouts. Everything a slot write does not reach stays zero. The base model's slot
(the last) has no block there: its rank is 0, so no row ever carries a value for it, and a block
of zeros would only widen every folded GEMM (1/9 of the widening at 8 adapter slots, half of it
at one).

Slot ranks and scalings also live on the device (`slot_ranks_device`, `slot_scalings_device`),
written by `_publish_slot` whenever a slot changes (load or free), never per forward: the
kernels read them directly.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Iterable, Optional

import torch

from sglang.srt.lora.backend._staging import copy_into
from sglang.srt.lora.eviction_policy import get_eviction_policy
from sglang.srt.lora.fold import (
    A_FOLD_MODULES,
    A_FOLD_PREFILL_MODULES,
    a_fold_views,
    fold_extra_columns,
    fold_weight,
    should_a_fold,
    should_fold,
)
from sglang.srt.lora.lora_config import LoRAConfig, get_stacked_multiply
from sglang.srt.lora.slot_loader import SlotLoader
from sglang.srt.utils import CumulativeHistogram

if TYPE_CHECKING:
    from sglang.srt.lora.lora import LoRAAdapter, LoRAModelShapes

logger = logging.getLogger(__name__)


class _EmptySlot:
    """Marks a free slot. Distinct from None, which is a valid lora_id (the base model)."""

    _instance: Optional["_EmptySlot"] = None

    def __new__(cls) -> "_EmptySlot":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "EMPTY"


EMPTY = _EmptySlot()
SLOT_LOAD_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


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
        fold_candidates: Iterable[str] = (),
        fold_mode: str = "auto",
        a_fold: bool = False,
        a_fold_prefill: bool = False,
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

        self._allocate(self._choose_folded(fold_candidates, fold_mode), a_fold, a_fold_prefill)

        self.slot_to_lora_id: list[object] = [EMPTY] * self.num_adapter_slots + [None]  # lora_id (str | None) or EMPTY
        self.lora_id_to_slot: dict[Optional[str], int] = {None: self.base_slot}
        # Rank and scaling of each slot's occupant (0 for EMPTY and the base model).
        self.slot_ranks: list[int] = [0] * self.num_slots
        self.slot_scalings: list[float] = [0.0] * self.num_slots
        self.slot_ranks_device = torch.zeros(self.num_slots, dtype=torch.int32, device=self.device)
        self.slot_scalings_device = torch.zeros(self.num_slots, dtype=torch.float32, device=self.device)
        # Per slot and module, the rank whose prefix holds non-zero weights (0: all zero).
        self._written_rank: list[dict[str, int]] = [{} for _ in range(self.num_slots)]
        self.loader = SlotLoader(self.device)
        # Counters for /get_server_info: adapter copies into a slot, evictions to make room, and
        # the copies issued ahead of need (prefetches).
        self.num_adapter_loads = 0
        self.num_evictions = 0
        # Host seconds per slot load (the copies are queued on the loader's stream): /metrics.
        self.load_seconds = CumulativeHistogram(SLOT_LOAD_SECONDS_BUCKETS)
        self.num_prefetches = 0

    # ------------------------------------------------------------------ layout
    def _choose_folded(self, candidates: Iterable[str], mode: str) -> list[str]:
        """Which candidate modules (those whose backend and base layer can fold) get W_aug:
        all of them with mode "on", those under fold.should_fold's byte bound with "auto"."""
        assert mode in ("auto", "on", "off"), mode
        if mode == "off":
            return []
        elem = torch.empty((), dtype=self.dtype).element_size()
        return [
            m
            for m in sorted(set(candidates))
            if mode == "on" or should_fold(self.shapes.modules[m].out_dim, self.fold_extra_columns(m), elem)
        ]

    def _allocate(self, fold_modules: Iterable[str], a_fold: bool = False, a_fold_prefill: bool = False) -> None:
        """A_buffer[module][layer]: [slots, c*R, in]; B_buffer[module][layer]: [slots, out, R]
        (a SlicedB over W_aug for folded modules, set by fold_base_weight). Zero-initialised, so no
        slot ever holds non-finite garbage a kernel or the folded GEMM could touch."""
        self.fold_modules: list[str] = sorted(set(fold_modules))
        unknown = set(self.fold_modules) - set(self.target_modules)
        assert not unknown, f"cannot fold modules outside the pool: {unknown}"
        self.A_buffer: dict[str, list[torch.Tensor]] = {}
        self.B_buffer: dict[str, list[Any]] = {}
        # W_aug per folded module and layer (None until fold_base_weight).
        self.folded_weight: dict[str, list[Optional[torch.Tensor]]] = {}
        # The A-fold (lora/fold.py, a_fold_views): folded one-slice modules (o_proj, down_proj) whose
        # W_aug buffer also holds A, as rows past N, so that one GEMM gives the base output and every
        # slot's shrink; B is also kept transposed [slots, R, N] for the norm that adds the delta.
        # With `a_fold_prefill`, qkv_proj too (A_FOLD_PREFILL_MODULES: its prefills only, no norm).
        self.a_fold_modules: list[str] = [
            m for m in self.fold_modules
            if ((a_fold and get_stacked_multiply(m) == 1 and m in A_FOLD_MODULES)
                or (a_fold_prefill and m in A_FOLD_PREFILL_MODULES)) and should_a_fold(
                self.shapes.modules[m].in_dim, self.shapes.modules[m].out_dim, self.num_fold_slots,
                get_stacked_multiply(m) * self.max_lora_rank, self.dtype.itemsize)
        ]
        self.a_folded_weight: dict[str, list[Optional[torch.Tensor]]] = {m: [None] * self.shapes.num_layers
                                                                          for m in self.a_fold_modules}
        self.Bt_buffer: dict[str, list[torch.Tensor]] = {}
        R, n = self.max_lora_rank, self.shapes.num_layers
        for module in self.target_modules:
            shape = self.shapes.modules[module]
            c = get_stacked_multiply(module)
            self.A_buffer[module] = [
                torch.zeros(self.num_slots, c * R, shape.in_dim, dtype=self.dtype, device=self.device)
                for _ in range(n)
            ]
            if module in self.fold_modules:
                self.B_buffer[module] = [None] * n
                self.folded_weight[module] = [None] * n
                if module in self.a_fold_modules:
                    self.A_buffer[module] = [None] * n  # views into W_aug's buffer (fold_base_weight)
                if module in self.a_fold_modules and module in A_FOLD_MODULES:  # the norm's copy of B
                    self.Bt_buffer[module] = [
                        torch.zeros(self.num_slots, R, shape.out_dim, dtype=self.dtype, device=self.device)
                        for _ in range(n)
                    ]
            else:
                self.B_buffer[module] = [
                    torch.zeros(self.num_slots, shape.out_dim, R, dtype=self.dtype, device=self.device)
                    for _ in range(n)
                ]

    @property
    def num_fold_slots(self) -> int:
        """Slots with a block in W_aug: the adapter slots, not the base model's (the last)."""
        assert self.base_slot == self.num_slots - 1, (self.base_slot, self.num_slots)
        return self.num_slots - 1

    def fold_extra_columns(self, module: str) -> int:
        """E of a folded module (every adapter slot's c*R block, padded)."""
        return fold_extra_columns(self.num_fold_slots, get_stacked_multiply(module), self.max_lora_rank)

    @torch.no_grad()
    def fold_base_weight(self, module: str, layer: int, weight: torch.Tensor) -> torch.Tensor:
        """Build W_aug for one folded module and layer from its base weight [N, K] and return it;
        this layer's B becomes the SlicedB over W_aug's extra columns. Once per layer, at start-up."""
        assert module in self.fold_modules and self.folded_weight[module][layer] is None, (module, layer)
        shape = self.shapes.modules[module]
        assert tuple(weight.shape) == (shape.out_dim, shape.in_dim), (module, tuple(weight.shape))
        a_fold = module in self.a_fold_modules
        R = self.max_lora_rank
        w_aug, b = fold_weight(
            weight.to(self.dtype), shape.out_sizes, self.num_fold_slots, R, self.fold_extra_columns(module),
            a_rows=self.num_slots * get_stacked_multiply(module) * R if a_fold else 0,
        )
        self.folded_weight[module][layer] = w_aug
        self.B_buffer[module][layer] = b
        if a_fold:
            # A rows for every slot (the kernels index A by slot), the GEMM only the adapter slots'.
            a, w_a = a_fold_views(w_aug, shape.in_dim, self.num_slots, R, self.num_fold_slots,
                                  get_stacked_multiply(module))
            self.A_buffer[module][layer], self.a_folded_weight[module][layer] = a, w_a
        return w_aug

    def _publish_slot(self, slot: int) -> None:
        """Copy one slot's rank and scaling to the device tensors the kernels read (on the
        current stream; the loading path calls it where it writes the slot's weights)."""
        copy_into(self.slot_ranks_device[slot : slot + 1], [self.slot_ranks[slot]])
        copy_into(self.slot_scalings_device[slot : slot + 1], [self.slot_scalings[slot]])

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
    def is_resident(self, lora_id: Optional[str]) -> bool:
        return lora_id in self.lora_id_to_slot

    def get_slot(self, lora_id: Optional[str]) -> int:
        return self.lora_id_to_slot[lora_id]

    def make_resident(
        self,
        lora_ids: set[Optional[str]],
        adapters: dict[str, "LoRAAdapter"],
        pinned_ids: Iterable[str] = (),
    ) -> None:
        """Give every adapter of `lora_ids` a slot, evicting others (never these or pinned ones),
        and make the current stream wait until their slots are written."""
        wanted = {u for u in lora_ids if u is not None}
        if len(wanted) > self.num_adapter_slots:
            raise ValueError(
                f"A batch uses {len(wanted)} distinct adapters but the LoRA pool has "
                f"{self.num_adapter_slots} adapter slots (--max-loras-per-batch); the scheduler must not admit it"
            )
        for lora_id in wanted:
            if lora_id not in adapters:
                raise ValueError(f"LoRA adapter id {lora_id!r} is not loaded")
        # Sorted only so that policy order and slot assignment are reproducible.
        ordered = sorted(wanted)
        for lora_id in ordered:
            self.eviction_policy.mark_used(lora_id)
        missing = [u for u in ordered if u not in self.lora_id_to_slot]
        if missing:  # (most batches find every adapter resident: no sets built, `pinned_ids` not read)
            keep = wanted | set(pinned_ids)  # the batch's adapters and the pinned ones stay
            for lora_id in missing:
                slot = self._free_slot(keep)
                assert slot is not None
                self._load(lora_id, slot, adapters[lora_id])
        self.loader.wait_for(self.lora_id_to_slot[u] for u in wanted)

    def prefetch(
        self,
        wanted: list[str],
        adapters: dict[str, "LoRAAdapter"],
        protected: Iterable[Optional[str]],
        pinned_ids: Iterable[str] = (),
    ) -> list[str]:
        """Load adapters that waiting requests will need, most wanted first, into free slots or in
        place of resident adapters that no waiting request wants and that are neither protected
        (the running batch's) nor pinned. The copies overlap the forward in flight; the batch that
        uses them waits for them (`make_resident`). Returns the lora_ids loaded."""
        keep = set(protected) | set(pinned_ids) | set(wanted)
        loaded = []
        for lora_id in wanted:
            if lora_id in self.lora_id_to_slot or lora_id not in adapters:
                continue
            slot = self._free_slot(keep, required=False)
            if slot is None:
                break
            self._load(lora_id, slot, adapters[lora_id])
            self.eviction_policy.mark_used(lora_id)  # about to be used: not the next victim
            self.num_prefetches += 1
            loaded.append(lora_id)
        return loaded

    def _free_slot(self, keep: set[Optional[str]], required: bool = True) -> Optional[int]:
        """An empty adapter slot, else the slot of an evicted adapter not in `keep`. None when
        every slot holds one of `keep`, or a ValueError if the slot is `required`."""
        for slot in range(self.num_adapter_slots):
            if self.slot_to_lora_id[slot] is EMPTY:
                return slot
        candidates = [u for u in self.lora_id_to_slot if u is not None and u not in keep]
        if not candidates:
            if not required:
                return None
            raise ValueError(
                f"No LoRA pool slot can be freed: all {self.num_adapter_slots} adapter slots hold adapters "
                "of the current batch or pinned adapters (the scheduler's admission must prevent this)"
            )
        victim = self.eviction_policy.select_victim(candidates)
        slot = self.lora_id_to_slot[victim]
        logger.debug("LoRA pool: evicting %r from slot %d", victim, slot)
        self.free(victim)
        self.num_evictions += 1
        return slot

    def free(self, lora_id: Optional[str]) -> None:
        """Forget a resident adapter (unload or eviction). Its slot becomes EMPTY; nothing moves.
        The base model's slot is never freed."""
        if lora_id is None:
            return
        slot = self.lora_id_to_slot.pop(lora_id, None)
        self.eviction_policy.remove(lora_id)
        if slot is None:
            return
        self.slot_to_lora_id[slot] = EMPTY
        self.slot_ranks[slot] = 0
        self.slot_scalings[slot] = 0.0
        self._publish_slot(slot)

    @torch.no_grad()
    def _load(self, lora_id: str, slot: int, adapter: "LoRAAdapter") -> None:
        assert self.slot_to_lora_id[slot] is EMPTY and slot != self.base_slot, "loading into an occupied slot"
        start = time.perf_counter()
        assert all(b is not None for m in self.fold_modules for b in self.B_buffer[m]), "fold_base_weight missing"
        r = adapter.rank
        present = adapter.modules
        written = self._written_rank[slot]
        with self.loader.writing(slot):
            for module in self.target_modules:
                c = get_stacked_multiply(module)
                old = written.get(module, 0)
                new = r if module in present else 0
                bt = self.Bt_buffer.get(module)
                for layer in range(self.shapes.num_layers):
                    a_slot = self.A_buffer[module][layer][slot]
                    b_slot = self.B_buffer[module][layer][slot]
                    bt_slot = bt[layer][slot] if bt is not None else None
                    weights = adapter.layers[layer].get(module)
                    if weights is not None:
                        a, b = weights
                        fits = a.shape == (c * r, a_slot.shape[1]) and b.shape == (b_slot.shape[0], r)
                        assert fits, f"{module} layer {layer}: shapes {tuple(a.shape)}, {tuple(b.shape)} do not fit the pool"
                        a_slot[: c * r].copy_(a, non_blocking=True)
                        b_slot[:, :r].copy_(b, non_blocking=True)
                        if bt_slot is not None:
                            bt_slot[:r].copy_(b.t(), non_blocking=True)
                    elif new:
                        # A layer the adapter skips inside a module it has: its prefix must be zero.
                        a_slot[: c * r].zero_()
                        b_slot[:, :r].zero_()
                        if bt_slot is not None:
                            bt_slot[:r].zero_()
                    if old > new:  # what the previous occupant left beyond the new prefix
                        a_slot[c * new : c * old].zero_()
                        b_slot[:, new:old].zero_()
                        if bt_slot is not None:
                            bt_slot[new:old].zero_()
                written[module] = new
            self.slot_ranks[slot] = r
            self.slot_scalings[slot] = float(adapter.scaling)
            self._publish_slot(slot)  # on the loader's stream, after the weights
        self.slot_to_lora_id[slot] = lora_id
        self.lora_id_to_slot[lora_id] = slot
        self.num_adapter_loads += 1
        self.load_seconds.observe(time.perf_counter() - start)

    # ------------------------------------------------------------------ checks
    def data_ptrs(self) -> list[int]:
        """Addresses of every buffer (tests assert they never change)."""
        return [t.data_ptr() for m in self.target_modules
                for t in self.A_buffer[m] + self.B_buffer[m] + self.Bt_buffer.get(m, [])]

    def integrity_problems(self) -> list[str]:
        problems: list[str] = []
        for lora_id, slot in self.lora_id_to_slot.items():
            if (
                not 0 <= slot < self.num_slots
                or self.slot_to_lora_id[slot] != lora_id
                or self.slot_to_lora_id[slot] is EMPTY
            ):
                problems.append(f"lora_id {lora_id!r} maps to slot {slot}, which holds {self.slot_to_lora_id[slot]!r}")
        for slot, lora_id in enumerate(self.slot_to_lora_id):
            if lora_id is EMPTY:
                if self.slot_ranks[slot] != 0:
                    problems.append(f"empty slot {slot} has rank {self.slot_ranks[slot]}")
                continue
            if self.lora_id_to_slot.get(lora_id) != slot:
                problems.append(f"slot {slot} holds {lora_id!r}, which maps to {self.lora_id_to_slot.get(lora_id)!r}")
            if lora_id is None and self.slot_ranks[slot] != 0:
                problems.append(f"base-model slot {slot} has rank {self.slot_ranks[slot]}, expected 0")
        if self.slot_to_lora_id[self.base_slot] is not None or self.lora_id_to_slot.get(None) != self.base_slot:
            problems.append(f"the base model does not hold its own slot {self.base_slot}")
        if any(r > self.max_lora_rank for r in self.slot_ranks):
            problems.append(f"slot ranks {self.slot_ranks} exceed the pool rank {self.max_lora_rank}")
        return problems
