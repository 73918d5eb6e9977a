"""Shrink and pack: the one LoRA kernel of a folded module (DESIGN §5, "LoRA folded into the GEMM").

A folded module computes `out = x_aug @ W_aug.T (+ bias)` with ONE cuBLAS GEMM, where

    W_aug [N, K + E] = [ W | B of every slot, block-diagonal per output slice ]
    x_aug [T, K + E] = [ x | each row's pre-scaled shrink in its own slot's block, zeros elsewhere ]

Slot s owns E columns [s*c*R, (s+1)*c*R) of the extra part (c output slices, R the pool rank);
within it, slice k's rank columns are [k*R, k*R + r) (r = the adapter's rank). The rows of output
slice k hold B_k there and zeros in the other slices' columns, so row t of x_aug, which carries
scaling * x[t] @ A_k[slot]^T in slice k's columns of its slot's block only, adds exactly
scaling * (x[t] A_k^T) B_k^T to the outputs of slice k. E may carry zero padding past S*c*R. A slot
with no block (the base model's, past the S adapter slots) has rank 0: its rows get zeros only.

This kernel writes all of x_aug[:num_rows] in one pass over x. Its grid is segments (lora/
segments.py: up to BLOCK_S rows of ONE slot, gathered through the batch's permutation; every row
is in exactly one segment) x column tiles of c*R x K splits. For the rows of its segment:
  columns [0, K)      a copy of x (every row, whatever its slot);
  own block           scaling[slot] * x @ A[slot, :c*r]^T, slice k at k*R + j (j < r);
  every other column  zero: other slots' blocks, rank columns j >= r, the padding, and all of E for
                      rows without an adapter (base model, rank-0 slots, padding rows).
Every element is written exactly once, by one program: the copy by the column-tile-0 program of
each K split, the zeros of a BLOCK_E-wide column stripe by one of the segment's programs (stripes
dealt out over all of them, written first: so no program's tail grows with the pool's slots), the
shrink values by the program that finishes the segment's reduction. So nothing needs clearing
between launches. The programs of an empty segment (a graph bucket's grid reaches past the live
batch's segments) return at once.

One slot per program: the reduction reads that adapter's A tile once for up to BLOCK_S rows, so
a batch costs its adapters' bytes, however its requests interleave them. Split-K partials meet in
an fp32 workspace and the last program of the segment (ticket counter, re-armed to 0) sums them in
a fixed order. Tiles and the split are functions of K and the widths alone, and a row's sums do
not depend on the other rows of its segment, so a graph replay on a padded bucket and an eager
pass on the live rows reduce every row in the same order: graph == eager, bit for bit.

With COPY_X False, x is x_aug's own first K columns (a strided view: the norm or activation before
the module wrote its output there, lora/norm_fusion.py) and the copy is skipped: only E is written.

With USE_PDL the kernel may be launched as a programmatic dependent of whatever kernel precedes
it (Hopper): it reads its segment's rows, slot and rank, then waits (`gdc_wait`) before touching x
or writing anything. Every program waits, so the kernel never completes before its predecessor.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sglang.srt.layers.triton_ops.common import gdc_wait
from sglang.srt.lora.triton_ops._token_rows import segment_rows, split_k_finish


@triton.jit
def _shrink_pack_kernel(
    x_ptr,
    w_ptr,
    xaug_ptr,
    part_ptr,
    counter_ptr,
    perm_ptr,
    seg_indptr_ptr,
    weight_indices_ptr,
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
    COPY_X: tl.constexpr = True,
):
    pid = tl.program_id(0)
    split = pid % SPLIT
    tile = pid // SPLIT
    tile_n = tile % n_tiles
    seg = tile // n_tiles
    rows, row_mask, active_rows, slot, rank = segment_rows(perm_ptr, seg_indptr_ptr, weight_indices_ptr, lora_ranks_ptr, seg,
                                              num_rows, BLOCK_S)
    if USE_PDL:
        gdc_wait()  # x is the previous kernel's output
    if tl.load(seg_indptr_ptr + seg) >= tl.load(seg_indptr_ptr + seg + 1):
        return  # an empty segment (past the live batch's): nothing to write
    active = rank > 0

    # ---- zeros: every extra column that is not one of the rows' own shrink values -------------
    # The segment's n_tiles * SPLIT programs take BLOCK_E-wide stripes of E in turn.
    block_w: tl.constexpr = STACK * MAX_RANK
    programs = n_tiles * SPLIT
    for e0 in range((tile_n * SPLIT + split) * BLOCK_E, E_COLS, programs * BLOCK_E):
        cols = e0 + tl.arange(0, BLOCK_E)
        # Rank 0 (no adapter): no column is a value, all of E is zeroed.
        is_value = ((cols // block_w) == slot) & (((cols % block_w) % MAX_RANK) < rank)
        mask = row_mask[:, None] & ((cols < E_COLS) & ~is_value)[None, :]
        ptrs = xaug_ptr + rows[:, None] * xaug_stride_t + K + cols[None, :]
        tl.store(ptrs, tl.zeros((BLOCK_S, BLOCK_E), dtype=xaug_ptr.dtype.element_ty), mask=mask)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = offs_n < STACK * rank  # the adapter's compact prefix
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)

    # ---- one pass over this split's K range: copy x, reduce with the segment's adapter ---------
    acc = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
    x_ptrs = x_ptr + rows[:, None] * x_stride_t + (k_lo + offs_k)[None, :]
    xaug_ptrs = xaug_ptr + rows[:, None] * xaug_stride_t + (k_lo + offs_k)[None, :]
    w_ptrs = (w_ptr + tl.maximum(slot, 0).to(tl.int64) * w_stride_s + offs_n[None, :] * w_stride_n
              + (k_lo + offs_k)[:, None])
    for k in range(k_lo, k_hi, BLOCK_K):
        k_mask = offs_k < k_hi - k
        tile_mask = row_mask[:, None] & k_mask[None, :]
        xt = tl.load(x_ptrs, mask=tile_mask, other=0.0)
        if COPY_X:
            if tile_n == 0:
                tl.store(xaug_ptrs, xt, mask=tile_mask)
        if active:
            b = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            acc = tl.dot(xt, b.to(xt.dtype), acc, input_precision=DOT_PREC)
        x_ptrs += BLOCK_K
        xaug_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    # ---- values: the segment's reduction, finished by one program ------------------------------
    if active:
        value_mask = active_rows[:, None] & col_mask[None, :]
        finisher = True
        if SPLIT > 1:
            # Workspace [SPLIT, num_rows, n_tiles * BLOCK_N]; part_plane = num_rows * that width.
            part_ptrs = part_ptr + (rows[:, None] * (n_tiles * BLOCK_N) + offs_n[None, :])
            finisher, acc = split_k_finish(acc, part_ptrs, part_plane, counter_ptr, tile, split, value_mask, SPLIT,
                                           BLOCK_S, BLOCK_N)
        if finisher:
            # Compact column n = k*r + j of the shrink goes to slice k's column k*R + j of the block.
            k_slice = offs_n // rank
            col = slot * block_w + k_slice * MAX_RANK + (offs_n - k_slice * rank)
            scaling = tl.load(scalings_ptr + slot)
            ptrs = xaug_ptr + rows[:, None] * xaug_stride_t + K + col[None, :]
            tl.store(ptrs, (acc * scaling).to(xaug_ptr.dtype.element_ty), mask=value_mask)
