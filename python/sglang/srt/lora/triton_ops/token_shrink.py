"""Token-major LoRA shrink: out[t, :c*r] = x[t] @ A[slot(t), :c*r].T, one grid over the batch's segments.

The grid is (segments) x (column tiles of c*R) x (K splits). A segment (lora/segments.py) is up to
BLOCK_S token rows of ONE slot, gathered through the batch's permutation, so each program reads one
adapter's A tile for its rows: the cost follows the adapters' bytes, not how requests interleave
them. Segments of rank-0 slots (the base model, padding) are neither read nor written. The grid's
segment axis is a function of the row count (segment_capacity under graphs), so one CUDA graph
captured for a bucket serves any number of requests within its rows.

Split-K without a memset and without atomics on data: when few segments cover a long K (decode,
short prefills), SPLIT programs share a segment's reduction. Each writes its fp32 partial sum to a
workspace, then takes a ticket from the segment's counter; the last to arrive adds the SPLIT
partials in fixed order (deterministic), writes the result and resets the counter to 0 for the
next launch. Counters must be zero before the first launch (allocate them with torch.zeros) and
stay zero between launches.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sglang.srt.layers.triton_ops.common import gdc_launch_dependents
from sglang.srt.lora.triton_ops._token_rows import segment_rows, split_k_finish


@triton.jit
def _token_shrink_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    part_ptr,
    counter_ptr,
    perm_ptr,
    seg_indptr_ptr,
    weight_indices_ptr,
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
    seg = tile // n_tiles
    rows, row_mask, active_rows, slot, rank = segment_rows(perm_ptr, seg_indptr_ptr, weight_indices_ptr, lora_ranks_ptr, seg,
                                              num_rows, BLOCK_S)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = offs_n < STACK * rank  # the adapter's compact prefix
    # Base rows, padding and empty segments are never touched.
    mask = active_rows[:, None] & col_mask[None, :]
    if tl.max(mask.to(tl.int32)) > 0:
        k_lo = split * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, K)
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rows[:, None] * x_stride_t + (k_lo + offs_k)[None, :]
        w_ptrs = w_ptr + slot.to(tl.int64) * w_stride_s + offs_n[None, :] * w_stride_n + (k_lo + offs_k)[:, None]
        acc = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
        for k in range(k_lo, k_hi, BLOCK_K):
            k_mask = offs_k < k_hi - k
            a = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            acc = tl.dot(a, b.to(a.dtype), acc, input_precision=DOT_PREC)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
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
