"""Jit helpers shared by the token-major LoRA kernels: which rows of a tile are active, which slots
they use, and the split-K ticket reduction. Also the grid-dependency-control intrinsics (Hopper
PDL), None where triton lacks them.
"""

from __future__ import annotations

import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - triton without grid dependency control
    gdc_launch_dependents = gdc_wait = None

# Above any real slot id (a constexpr: jit code may read no other globals).
_NO_SLOT_HIGH = tl.constexpr(1 << 30)


@triton.jit
def tile_rows(token_slots_ptr, lora_ranks_ptr, tile_t, num_rows, BLOCK_S: tl.constexpr):
    """(row offsets, slot, rank, active) of token tile `tile_t`. Rows past the batch and rows with
    slot -1 (padding) or a rank-0 slot (the base model) are inactive: never read, never written."""
    offs_s = tile_t * BLOCK_S + tl.arange(0, BLOCK_S)
    slot = tl.load(token_slots_ptr + offs_s, mask=offs_s < num_rows, other=-1)
    rank = tl.load(lora_ranks_ptr + slot, mask=slot >= 0, other=0)
    return offs_s, slot, rank, rank > 0


@triton.jit
def slot_range(slot, active):
    """Lowest and highest slot among the active rows (equal: one adapter in the tile)."""
    lo = tl.min(tl.where(active, slot, _NO_SLOT_HIGH), axis=0)
    hi = tl.max(tl.where(active, slot, -1), axis=0)
    return lo, hi


@triton.jit
def split_k_finish(acc, part_ptrs, part_plane, counter_ptr, tile, split, mask, SPLIT: tl.constexpr,
                   BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr):
    """Split-K without a memset and without atomics on data. Each of the tile's SPLIT programs
    writes its fp32 partial (`part_ptrs` + split * part_plane), then takes a ticket from the tile's
    counter; the last to arrive sums the partials in fixed order (deterministic) and re-arms the
    counter to 0 for the next launch. Returns (this program finishes the tile, the sum)."""
    tl.store(part_ptrs + split * part_plane, acc, mask=mask)
    # Every thread's partial is written before the ticket is taken (release at GPU scope).
    tl.debug_barrier()
    ticket = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
    finisher = ticket == SPLIT - 1
    total = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
    if finisher:
        # All other partials are visible (acquire): sum them bypassing L1 (written by other SMs).
        tl.atomic_xchg(counter_ptr + tile, 0, sem="relaxed", scope="gpu")
        for p in range(SPLIT):
            total += tl.load(part_ptrs + p * part_plane, mask=mask, other=0.0, cache_modifier=".cg")
    return finisher, total
