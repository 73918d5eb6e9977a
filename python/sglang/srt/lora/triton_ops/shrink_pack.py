"""Shrink and pack: the one LoRA kernel of a folded module (DESIGN §5, "LoRA folded into the GEMM").

A folded module computes `out = x_aug @ W_aug.T (+ bias)` with ONE cuBLAS GEMM, where

    W_aug [N, K + E] = [ W | B of every slot, block-diagonal per output slice ]
    x_aug [T, K + E] = [ x | each row's pre-scaled shrink in its own slot's block, zeros elsewhere ]

Slot s owns E columns [s*c*R, (s+1)*c*R) of the extra part (c output slices, R the pool rank);
within it, slice k's rank columns are [k*R, k*R + r) (r = the adapter's rank). The rows of output
slice k hold B_k there and zeros in the other slices' columns, so row t of x_aug, which carries
scaling * x[t] @ A_k[slot]^T in slice k's columns of its slot's block only, adds exactly
scaling * (x[t] A_k^T) B_k^T to the outputs of slice k. E may carry zero padding past S*c*R.

This kernel writes all of x_aug[:num_rows] in one pass over x:
  columns [0, K)      a copy of x (every row, whatever its slot);
  own block           scaling[slot] * x @ A[slot, :c*r]^T, slice k at k*R + j (j < r);
  every other column  zero: other slots' blocks, rank columns j >= r, the padding, and all of E for
                      rows without an adapter (base model, rank-0 slots, padding rows with slot -1).
Every element is written exactly once, by one program: the copy by the column-tile-0 program of
each K split, the zeros by the (split 0, column tile 0) program, the shrink values by the program
that finishes the tile's reduction. So nothing needs clearing between launches.

The reduction is the token-major shrink's (token_shrink.py): grid = token tiles x column tiles of
c*R x K splits, depending on the row count only; a tile of one slot runs one masked reduction,
a tile that mixes slots adds each slot's rows in turn; split-K partials meet in an fp32 workspace
and the last program of the tile (ticket counter, re-armed to 0) sums them in a fixed order. The
split is a function of K alone, so a graph replay on a padded bucket and an eager pass on the live
rows reduce every row in the same order: graph == eager, bit for bit.

With USE_PDL the kernel may be launched as a programmatic dependent of whatever kernel precedes
it (Hopper): it reads its rows' slots and ranks, then waits (`gdc_wait`) before touching x or
writing anything.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sglang.srt.lora.triton_ops._token_rows import gdc_wait, slot_range, split_k_finish, tile_rows


@triton.jit
def _pack_shrink_step(acc, xt, w_ptr, slot, rank, mine, offs_n, offs_k, k, k_hi, w_stride_s, w_stride_n,
                      STACK: tl.constexpr, DOT_PREC: tl.constexpr):
    """acc += x tile (rows in `mine` only) @ A[slot, offs_n, k:k+BLOCK_K].T."""
    k_mask = offs_k < k_hi - k
    col_mask = offs_n < STACK * rank  # the adapter's compact prefix
    w_ptrs = w_ptr + slot * w_stride_s + offs_n[None, :] * w_stride_n + (k + offs_k)[:, None]
    b = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
    a = tl.where(mine[:, None], xt, 0.0)
    return tl.dot(a, b.to(a.dtype), acc, input_precision=DOT_PREC)


@triton.jit
def _shrink_pack_kernel(
    x_ptr,
    w_ptr,
    xaug_ptr,
    part_ptr,
    counter_ptr,
    token_slots_ptr,
    lora_ranks_ptr,
    scalings_ptr,
    num_rows,
    part_plane,
    K,
    k_per_split,
    x_stride_t,
    w_stride_s,
    w_stride_n,
    xaug_stride_t,
    n_tiles,
    STACK: tl.constexpr,
    MAX_RANK: tl.constexpr,
    E_COLS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    split = pid % SPLIT
    tile = pid // SPLIT
    tile_n = tile % n_tiles
    tile_t = tile // n_tiles
    offs_s, slot, rank, active = tile_rows(token_slots_ptr, lora_ranks_ptr, tile_t, num_rows, BLOCK_S)
    if USE_PDL:
        gdc_wait()  # x is the previous kernel's output
    in_rows = offs_s < num_rows
    rows = offs_s.to(tl.int64)
    any_active = tl.max(active.to(tl.int32), axis=0) > 0
    lo, hi = slot_range(slot, active)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)

    # ---- one pass over this split's K range: copy x, reduce the active rows -----------------
    acc = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
    x_ptrs = x_ptr + rows[:, None] * x_stride_t + (k_lo + offs_k)[None, :]
    xaug_ptrs = xaug_ptr + rows[:, None] * xaug_stride_t + (k_lo + offs_k)[None, :]
    for k in range(k_lo, k_hi, BLOCK_K):
        k_mask = offs_k < k_hi - k
        tile_mask = in_rows[:, None] & k_mask[None, :]
        xt = tl.load(x_ptrs, mask=tile_mask, other=0.0)
        if tile_n == 0:
            tl.store(xaug_ptrs, xt, mask=tile_mask)
        if any_active:
            if lo == hi:
                acc = _pack_shrink_step(acc, xt, w_ptr, lo, tl.load(lora_ranks_ptr + lo), active, offs_n, offs_k,
                                        k, k_hi, w_stride_s, w_stride_n, STACK, DOT_PREC)
            else:
                for s in range(lo, hi + 1):
                    mine = active & (slot == s)
                    if tl.max(mine.to(tl.int32), axis=0) > 0:
                        acc = _pack_shrink_step(acc, xt, w_ptr, s, tl.load(lora_ranks_ptr + s), mine, offs_n,
                                                offs_k, k, k_hi, w_stride_s, w_stride_n, STACK, DOT_PREC)
        x_ptrs += BLOCK_K
        xaug_ptrs += BLOCK_K

    # ---- zeros: every extra column that is not one of the row's own shrink values -----------
    block_w: tl.constexpr = STACK * MAX_RANK
    if (split == 0) & (tile_n == 0):
        for e0 in range(0, E_COLS, BLOCK_E):
            cols = e0 + tl.arange(0, BLOCK_E)
            own = active[:, None] & ((cols // block_w)[None, :] == slot[:, None])
            is_value = own & (((cols % block_w) % MAX_RANK)[None, :] < rank[:, None])
            mask = in_rows[:, None] & (cols < E_COLS)[None, :] & ~is_value
            ptrs = xaug_ptr + rows[:, None] * xaug_stride_t + K + cols[None, :]
            tl.store(ptrs, tl.zeros((BLOCK_S, BLOCK_E), dtype=xaug_ptr.dtype.element_ty), mask=mask)

    # ---- values: the tile's reduction, finished by one program ------------------------------
    if any_active:
        value_mask = active[:, None] & (offs_n[None, :] < (STACK * rank)[:, None])
        finisher = True
        if SPLIT > 1:
            # Workspace [SPLIT, num_rows, n_tiles * BLOCK_N]; part_plane = num_rows * that width.
            part_ptrs = part_ptr + (rows[:, None] * (n_tiles * BLOCK_N) + offs_n[None, :])
            finisher, acc = split_k_finish(acc, part_ptrs, part_plane, counter_ptr, tile, split, value_mask, SPLIT,
                                           BLOCK_S, BLOCK_N)
        if finisher:
            # Compact column n = k*r + j of the shrink goes to slice k's column k*R + j of the block.
            r_div = tl.where(rank > 0, rank, 1)[:, None]
            k_slice = offs_n[None, :] // r_div
            col = slot[:, None] * block_w + k_slice * MAX_RANK + (offs_n[None, :] - k_slice * r_div)
            scaling = tl.load(scalings_ptr + slot, mask=active, other=0.0)
            ptrs = xaug_ptr + rows[:, None] * xaug_stride_t + K + col
            tl.store(ptrs, (acc * scaling[:, None]).to(xaug_ptr.dtype.element_ty), mask=value_mask)
