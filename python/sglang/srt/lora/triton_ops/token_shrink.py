"""Token-major LoRA shrink: out[t, :c*r] = x[t] @ A[slot(t), :c*r].T, one grid over token tiles.

The grid is (token tiles of the batch's rows) x (column tiles of c*R) x (K splits): it depends on
the row count only, never on how many requests or adapters the batch has. So one CUDA graph
captured for a bucket serves any number of requests within its rows, and no program is launched for
segments that do not exist. Each token row names its slot in `token_slots` (int32 [rows], -1 for
rows outside every request, e.g. padding); a row whose slot has rank 0 (the base model) or -1 is
never read or written.

A tile whose active rows share one slot (a prefill tile inside one request: the common case) does
one masked reduction; a tile that mixes slots (decode, request boundaries) loops over the slots in
[lowest, highest] present, each with its own rows.

Split-K without a memset and without atomics on data: when few token tiles cover a long K (decode,
short prefills), SPLIT programs share a tile's reduction. Each writes its fp32 partial sum to a
workspace, then takes a ticket from the tile's counter; the last to arrive adds the SPLIT partials
in fixed order (deterministic), writes the result and resets the counter to 0 for the next launch.
Counters must be zero before the first launch (allocate them with torch.zeros) and stay zero
between launches.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sglang.srt.lora.triton_ops._token_rows import gdc_launch_dependents, slot_range, split_k_finish, tile_rows


@triton.jit
def _shrink_one_slot(
    x_ptr,
    w_ptr,
    slot,
    rank,
    rows,
    row_mask,
    offs_n,
    k_lo,
    k_hi,
    x_stride_t,
    w_stride_s,
    w_stride_n,
    STACK: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """x[rows] @ A[slot, offs_n, k_lo:k_hi].T for the rows in row_mask (others contribute 0)."""
    col_mask = offs_n < STACK * rank  # the adapter's compact prefix
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * x_stride_t + (k_lo + offs_k)[None, :]
    w_ptrs = w_ptr + slot * w_stride_s + offs_n[None, :] * w_stride_n + (k_lo + offs_k)[:, None]
    acc = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        k_mask = offs_k < k_hi - k
        a = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(a, b.to(a.dtype), acc, input_precision=DOT_PREC)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@triton.jit
def _token_shrink_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    part_ptr,
    counter_ptr,
    token_slots_ptr,
    lora_ranks_ptr,
    num_rows,
    part_plane,
    K,
    k_per_split,
    x_stride_t,
    w_stride_s,
    w_stride_n,
    out_stride_t,
    n_tiles,
    STACK: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        # The expand may be scheduled as soon as every shrink program runs; it waits for our
        # results itself (gdc_wait) and meanwhile loads its base-output tile.
        gdc_launch_dependents()
    pid = tl.program_id(0)
    split = pid % SPLIT
    tile = pid // SPLIT
    tile_n = tile % n_tiles
    tile_t = tile // n_tiles
    # Slot and rank first: base rows, padding and rows past the batch are never touched.
    offs_s, slot, rank, active = tile_rows(token_slots_ptr, lora_ranks_ptr, tile_t, num_rows, BLOCK_S)
    if tl.max(active.to(tl.int32), axis=0) > 0:
        rows = offs_s.to(tl.int64)
        offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        k_lo = split * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, K)
        lo, hi = slot_range(slot, active)
        if lo == hi:
            acc = _shrink_one_slot(
                x_ptr, w_ptr, lo, tl.load(lora_ranks_ptr + lo), rows, active, offs_n, k_lo, k_hi,
                x_stride_t, w_stride_s, w_stride_n, STACK, BLOCK_S, BLOCK_N, BLOCK_K, DOT_PREC,
            )
        else:
            acc = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
            for s in range(lo, hi + 1):
                mine = active & (slot == s)
                if tl.max(mine.to(tl.int32), axis=0) > 0:
                    acc += _shrink_one_slot(
                        x_ptr, w_ptr, s, tl.load(lora_ranks_ptr + s), rows, mine, offs_n, k_lo, k_hi,
                        x_stride_t, w_stride_s, w_stride_n, STACK, BLOCK_S, BLOCK_N, BLOCK_K, DOT_PREC,
                    )
        # Per row: only the columns of its own adapter's prefix.
        mask = active[:, None] & (offs_n[None, :] < (STACK * rank)[:, None])
        out_ptrs = out_ptr + rows[:, None] * out_stride_t + offs_n[None, :]
        if SPLIT == 1:
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            # Workspace [SPLIT, num_rows, n_tiles * BLOCK_N]; part_plane = num_rows * that width.
            part_ptrs = part_ptr + (rows[:, None] * (n_tiles * BLOCK_N) + offs_n[None, :])
            finisher, total = split_k_finish(acc, part_ptrs, part_plane, counter_ptr, tile, split, mask, SPLIT,
                                             BLOCK_S, BLOCK_N)
            if finisher:
                tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
