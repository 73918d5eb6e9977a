"""How many adapter slots the pool gets when `--max-loras-per-batch` is not given.

Enough for every startup adapter (at least DEFAULT_SLOTS, SGLang's default, and one more than the
pinned ones: pinning must leave a slot free for unpinned adapters), so that a server
started with 64 adapters can batch all 64 at once, within a memory budget: at most
AUTO_POOL_MEMORY_FRACTION of the device's memory, so the CUDA graphs and the KV pool keep their
share (the KV pool is sized after the LoRA pool, from what is left), and at most AUTO_MAX_SLOTS.
Adapters loaded later than that, or beyond it, take turns in the slots (the pool evicts and
reloads them). On a CPU there is no device budget: the startup count alone decides.

Every tensor-parallel rank takes the smallest count of all ranks (their batches must agree).
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Optional

import torch

from sglang.srt.lora.fold import A_FOLD_MODULES, should_a_fold
from sglang.srt.lora.lora import LoRAModelShapes
from sglang.srt.lora.lora_config import get_stacked_multiply

logger = logging.getLogger(__name__)

DEFAULT_SLOTS = 8
AUTO_POOL_MEMORY_FRACTION = 0.05  # 7 GiB of an H200: ~100 rank-16 slots of a 4B model
AUTO_MAX_SLOTS = 256


def slot_bytes(shapes: LoRAModelShapes, target_modules: Iterable[str], max_rank: int, dtype: torch.dtype,
               a_fold_slots: int = 0) -> int:
    """Device bytes one slot takes: A [c*R, in] and B [out, R] of every module, every layer; with
    `a_fold_slots`, also the transposed B [R, out] that the A-fold keeps for o_proj / down_proj
    where it applies at that many slots (fold.should_a_fold; counted whether or not the backend
    takes it, so the budget errs on the side of the KV pool)."""
    per_layer = 0
    for module in target_modules:
        shape = shapes.modules[module]
        per_layer += get_stacked_multiply(module) * max_rank * shape.in_dim + shape.out_dim * max_rank
        if a_fold_slots and module in A_FOLD_MODULES and should_a_fold(
                shape.in_dim, shape.out_dim, a_fold_slots, max_rank, dtype.itemsize):
            per_layer += shape.out_dim * max_rank
    return per_layer * shapes.num_layers * dtype.itemsize


def auto_slot_count(
    shapes: LoRAModelShapes,
    target_modules: Iterable[str],
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device,
    num_startup_adapters: int,
    max_loaded_loras: Optional[int] = None,
    agree: Callable[[int], int] = lambda n: n,
    num_startup_pinned: int = 0,
) -> int:
    """The slot count for an unset --max-loras-per-batch (see the module doc); logged."""
    # pinned + 1: with every startup adapter pinned, a pool of exactly their count would refuse the
    # last pin (at most slots - 1 may be pinned) on a slot count the user never chose.
    wanted = max(DEFAULT_SLOTS, num_startup_adapters, num_startup_pinned + 1)
    if max_loaded_loras is not None:
        wanted = min(wanted, max_loaded_loras)  # more slots than loadable adapters would sit empty
    per_slot = slot_bytes(shapes, target_modules, max_rank, dtype)
    budget_note = "no device memory budget on the CPU"
    slots = min(wanted, AUTO_MAX_SLOTS)
    if device.type == "cuda":
        budget = AUTO_POOL_MEMORY_FRACTION * torch.cuda.mem_get_info(device)[1]
        slots = min(slots, max(1, int(budget // per_slot)))
        # The A-fold's copy of B where it applies at that count (fewer slots keep it too).
        per_slot = slot_bytes(shapes, target_modules, max_rank, dtype, a_fold_slots=slots)
        slots = min(slots, max(1, int(budget // per_slot)))
        budget_note = f"within {AUTO_POOL_MEMORY_FRACTION:.0%} of the device memory, {budget / 2**30:.1f} GiB"
    slots = agree(slots)
    logger.info(
        "LoRA pool: %d adapter slots (--max-loras-per-batch unset: %d startup adapters, at least %d, %s; "
        "%.1f MiB per slot)", slots, num_startup_adapters, DEFAULT_SLOTS, budget_note, per_slot / 2**20,
    )
    return slots
