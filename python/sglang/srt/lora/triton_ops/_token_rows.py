"""Jit helpers shared by the token-major LoRA kernels: which rows of a tile are active, and which
slots they use. Also the grid-dependency-control intrinsics (Hopper PDL), None where triton lacks them.
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
