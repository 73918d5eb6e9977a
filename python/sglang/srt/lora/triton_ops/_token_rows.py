"""Jit helpers shared by the LoRA kernels: a segment's slot and rank, an expand's output slice
columns, where a program of the segmented (csgmv) kernels starts, the rows and slot of one
token-major segment, and the split-K ticket reduction. (The grid-dependency-control intrinsics
the kernels use for Hopper PDL live in layers/triton_ops/common.py.)
"""

from __future__ import annotations

import triton
import triton.language as tl



@triton.jit
def segment_slot_rank(weight_indices_ptr, lora_ranks_ptr, seg):
    """(slot, rank) of segment `seg`. Slot -1 (no adapter) reads as rank 0."""
    slot = tl.load(weight_indices_ptr + seg)
    rank = tl.where(slot >= 0, tl.load(lora_ranks_ptr + tl.maximum(slot, 0)), 0)
    return slot, rank


@triton.jit
def slice_columns(slice_offsets_ptr, slice_id, slice_width, HAS_OFFSETS: tl.constexpr, OFFSET_ALIGN: tl.constexpr):
    """[col_lo, col_hi) of an expand's output slice `slice_id`: loaded offsets (qkv, whose q and kv
    widths may differ) or equal slices of `slice_width`."""
    if HAS_OFFSETS:
        # Loaded offsets carry no alignment facts; the host-derived hint restores vectorised
        # access to the output's columns.
        col_lo = tl.multiple_of(tl.load(slice_offsets_ptr + slice_id), OFFSET_ALIGN)
        col_hi = tl.multiple_of(tl.load(slice_offsets_ptr + slice_id + 1), OFFSET_ALIGN)
    else:
        col_lo = slice_id * slice_width
        col_hi = col_lo + slice_width
    return col_lo, col_hi


@triton.jit
def segment_lane_start(seg_indptr_ptr, seg, n_tiles, BLOCK_S: tl.constexpr):
    """A segmented kernel's program (axis 0 = token lane x column tile, _tiles.py): (the
    segment's end, its column tile, the first row of its lane)."""
    seg_start = tl.load(seg_indptr_ptr + seg)
    seg_end = tl.load(seg_indptr_ptr + seg + 1)
    pid = tl.program_id(0)
    tile_n = pid % n_tiles
    lane = pid // n_tiles
    return seg_end, tile_n, seg_start + lane * BLOCK_S


@triton.jit
def segment_rows(perm_ptr, seg_indptr_ptr, weight_indices_ptr, lora_ranks_ptr, seg, num_rows,
                 BLOCK_S: tl.constexpr):
    """(rows, row mask, active row mask, slot, rank) of segment `seg` (lora/segments.py): up to
    BLOCK_S token rows that share one slot, gathered through the permutation. The row mask drops
    positions past the segment's end and rows past the batch (a bucket's grid reads segments that
    reach beyond it); the active mask also drops every row when the slot has rank 0 (the base
    model, padding, an empty slot: nothing to add). Slot -1 reads as rank 0."""
    start = tl.load(seg_indptr_ptr + seg)
    end = tl.load(seg_indptr_ptr + seg + 1)
    slot, rank = segment_slot_rank(weight_indices_ptr, lora_ranks_ptr, seg)
    offs = start + tl.arange(0, BLOCK_S)
    in_seg = offs < end
    rows = tl.load(perm_ptr + offs, mask=in_seg, other=0)
    row_mask = in_seg & (rows < num_rows)
    # Block-vs-scalar comparisons only (the interpreter rejects a block mask & a scalar bool).
    active_rows = row_mask & (offs < tl.where(rank > 0, end, start))
    return rows.to(tl.int64), row_mask, active_rows, slot, rank


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
