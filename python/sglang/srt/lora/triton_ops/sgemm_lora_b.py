"""Segmented LoRA expand: base_output[t, slice] += scaling * x[t, k*r:(k+1)*r] @ B[slot, slice, :r].T

csgmv's unfolded modules: plain (1 slice), gate_up (2 equal slices), qkv (3 slices at
`slice_offsets`, q and kv widths may differ), rows gathered and scattered through
`batch_info.permutation`. Grid: (token lanes x column tiles, slices, segments).

Every output element is one dot over the rank, computed by one program; the tile width is a
launch constant (EXPAND_TILES), the same under a graph and eagerly, so a graph replay and an eager
pass add the same bits.

With USE_PDL (`use_pdl` and at most PDL_MAX_ROWS rows) the kernel is launched as a programmatic
dependent of the kernel before it (Hopper; at decode the module's GEMM): its first two load rounds
read only the batch's metadata and B, which no kernel of the forward writes, so they overlap that
kernel's tail; every program then waits (`gdc_wait`) before it reads x or the output tile, and
before it leaves, also those with nothing to do, so the kernel never completes before the one it
depends on (a dependent of this kernel may rely on that). The launch mode moves no sum.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from sglang.srt.layers.triton_ops.common import dot_precision, gdc_wait
from sglang.srt.lora.triton_ops._token_rows import segment_lane_start, slice_columns
from sglang.srt.lora.triton_ops._tiles import rank_block, token_block, token_lanes
from sglang.srt.lora.utils import LoRABatchInfo


@triton.jit
def _segment_expand_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    x_stride_t,
    x_stride_r,
    x_slot_stride,
    w_stride_s,
    w_stride_slice,
    w_stride_n,
    w_stride_r,
    out_stride_t,
    out_stride_n,
    seg_indptr_ptr,
    weight_indices_ptr,
    lora_ranks_ptr,
    scalings_ptr,
    perm_ptr,
    slice_offsets_ptr,
    slice_width,
    n_tiles,
    lanes,
    HAS_OFFSETS: tl.constexpr,
    OFFSET_ALIGN: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    R_ITERS: tl.constexpr,
    LANE_ITERS: tl.constexpr,
    DOT_PREC: tl.constexpr,
    B_EARLY: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    seg = tl.program_id(2)
    slice_id = tl.program_id(1)
    # The loads go in three dependent rounds (fewer rounds, shorter programs: at decode the kernel is
    # bound by its programs' latency, not by bytes): (slot, segment bounds, slice columns) ->
    # (rank, scaling, the first tile's rows) -> (x, B and the output tile, together).
    slot = tl.load(weight_indices_ptr + seg)
    seg_end, tile_n, first_row = segment_lane_start(seg_indptr_ptr, seg, n_tiles, BLOCK_S)
    col_lo, col_hi = slice_columns(slice_offsets_ptr, slice_id, slice_width, HAS_OFFSETS, OFFSET_ALIGN)
    col0 = col_lo + tile_n * BLOCK_N
    # Empty segments (most of a graph bucket's) and the narrower slices' spare column tiles (kv
    # under GQA) leave after the first round (launched as a dependent: after the wait below).
    empty = (first_row >= seg_end) | (col0 >= col_hi)
    if not USE_PDL:
        if empty:
            return
    offs_n = col0 + tl.arange(0, BLOCK_N)
    col_mask = offs_n < col_hi
    offs_r = tl.arange(0, BLOCK_R)
    # w_stride_slice: 0 for a plain B; a folded module's B lives in W_aug, slice k's rank columns
    # k*R past its slot's block (lora/fold.py).
    w_base = (w_ptr + tl.maximum(slot, 0).to(tl.int64) * w_stride_s + slice_id * w_stride_slice
              + offs_n[None, :].to(tl.int64) * w_stride_n)
    if B_EARLY:
        # B's first rank block depends on the slot alone: in flight with the rank and the rows
        # (round 2) rather than after them. Unmasked by the rank (not known yet): the rows past
        # it are zeroed once it is, as the masked load would have left them. (Rank-0 segments
        # load their slot's block for nothing: one small tile, from L2 after the first.)
        b_cols = col_mask
        if USE_PDL:  # empty segments are still here: they load nothing
            b_cols = offs_n < tl.where(first_row < seg_end, col_hi, 0)
        b_first = tl.load(w_base + offs_r[:, None] * w_stride_r, mask=b_cols[None, :], other=0.0)
    rank = tl.where(slot >= 0, tl.load(lora_ranks_ptr + tl.maximum(slot, 0)), 0)
    scaling = tl.load(scalings_ptr + tl.maximum(slot, 0))
    first_offs = first_row + tl.arange(0, BLOCK_S)
    first_rows = tl.load(perm_ptr + first_offs, mask=first_offs < seg_end, other=0).to(tl.int64)
    if USE_PDL:
        # Everything above is metadata and B; x and the output tile are the GEMM's, read below.
        gdc_wait()
        if empty:
            return
    if rank == 0:  # base requests and padding rows
        return
    if B_EARLY:
        b_first = tl.where(offs_r[:, None] < rank, b_first, 0.0).to(b_first.dtype)

    # This lane's token tiles: first_row + i * lanes * BLOCK_S, skipped past the segment end.
    for it in tl.static_range(LANE_ITERS):
        row0 = first_row + it * lanes * BLOCK_S
        if row0 < seg_end:
            offs_s = row0 + tl.arange(0, BLOCK_S)
            row_mask = offs_s < seg_end
            if it == 0:
                rows = first_rows
            else:
                rows = tl.load(perm_ptr + offs_s, mask=row_mask, other=0).to(tl.int64)
            out_ptrs = out_ptr + rows[:, None] * out_stride_t + offs_n[None, :] * out_stride_n
            mask = row_mask[:, None] & col_mask[None, :]
            base = tl.load(out_ptrs, mask=mask, other=0.0)  # in flight with x and B
            # Slice k of the shrink output holds columns [k*rank, (k+1)*rank) (compact prefix), past
            # slot * x_slot_stride when x holds every slot's shrink (the A-fold's GEMM output).
            x_cols = tl.maximum(slot, 0) * x_slot_stride + slice_id * rank + offs_r
            x_ptrs = x_ptr + rows[:, None] * x_stride_t + x_cols[None, :] * x_stride_r
            w_ptrs = w_base + offs_r[:, None] * w_stride_r
            acc = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
            for ri in tl.static_range(R_ITERS):
                # K is clipped to the slot's rank: columns past it may hold stale or
                # uninitialised data.
                r_mask = offs_r < rank - ri * BLOCK_R
                a = tl.load(x_ptrs, mask=row_mask[:, None] & r_mask[None, :], other=0.0)
                if B_EARLY and ri == 0:  # the same block for every token tile of the lane
                    b = b_first
                else:
                    b = tl.load(w_ptrs, mask=r_mask[:, None] & col_mask[None, :], other=0.0)
                # Compute in the weights' dtype: an fp32 (split-K) shrink output is rounded like
                # a bf16 one would have been, and bf16 x bf16 keeps the tensor-core path.
                acc = tl.dot(a.to(b.dtype), b, acc, input_precision=DOT_PREC)
                x_ptrs += BLOCK_R * x_stride_r
                w_ptrs += BLOCK_R * w_stride_r

            result = base.to(tl.float32) + acc * scaling
            tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=mask)


# (BLOCK_N, warps) of the expand's column tiles. bench_expand_tiles.py (H200, 2026-12-02, Qwen3-4B,
# rank 16, 64 slots) measured 256-wide tiles the best or within 0.4 µs of it in every case:
# qkv_proj / gate_up_proj µs per launch against 128-wide, decode 64 on 1 adapter 3.8 / 5.2 (4.9 /
# 7.6), on 8 4.8 / 7.1 (5.3 / 9.6), on 32 7.3 / 14.9 (7.5 / 16.2), on 64 11.5 / 25.8 (11.4 / 26.3),
# prefill 8 x 256 21.3 / 59.0 (23.6 / 63.2); the same bits in every case. Several 128-wide tiles
# per program lost (longer programs, fewer of them in flight), so a program covers one tile; so did
# several segments per program (2026-12-04: a batched dot over 2-8 segments, 1.3-2.6x slower).
# "b-early" loads B's first rank block in the second load round (with the rank and the rows) rather
# than the third. bench_expand_tiles (2026-12-04), qkv / gate_up µs per launch, with it (without):
# decode 64 on 8 adapters 4.2 / 6.2 (4.8 / 7.1), on 64 8.8 / 19.8 (11.1 / 25.7), prefill 8 x 256
# 17.0 / 48.0 (20.3 / 57.2); the same bits. Whole decode steps at 64 slots (profile_forward) spent
# 1,481 / 1,883 / 2,760 µs of LoRA kernels on 8 / 32 / 64 adapters without it, 1,408 / 1,760 / 2,464 with.
EXPAND_TILES = (256, 4, "b-early")
# With the backend's `use_pdl`, launches of at most this many rows go as programmatic dependents
# (see the module doc); SGLANG_LORA_EXPAND_PDL_ROWS, 0 (never) by default. profile_forward's
# `lora-expand-pdl` variant sets it past every bucket. On the H200 (2026-12-04, 8 rank-16 adapters,
# decode graphs) the engine's graph = eager tests pass with it at 64 rows, and a step of 64 requests
# on 8 adapters spends 0.5% less GPU time (LoRA kernels 705 -> 681 µs on the Qwen3-4B shape, 715 ->
# 689 on the 8B one), which the walls did not show (5.437 against 5.427 ms, 6.700 against 6.717):
# too little to make it the default.
PDL_MAX_ROWS = int(os.environ.get("SGLANG_LORA_EXPAND_PDL_ROWS", "0"))


def segmented_expand(
    x: torch.Tensor,
    weights: torch.Tensor,
    batch_info: LoRABatchInfo,
    base_output: torch.Tensor,
    num_slices: int,
    slice_offsets: Optional[torch.Tensor] = None,
    max_slice_width: Optional[int] = None,
    tiles: Optional[tuple] = None,
    slice_stride: int = 0,
    x_slot_stride: int = 0,
    use_pdl: bool = False,
) -> torch.Tensor:
    """Launch the expand over `batch_info`'s grid, accumulating into `base_output` in place.

    Slices are either given by `slice_offsets` (int device tensor [num_slices + 1]; then
    `max_slice_width` bounds the column grid) or, when None, equal: out_dim / num_slices each.
    `slice_stride` moves slice k's B by k * slice_stride elements (a folded module's B inside
    W_aug, lora/fold.py `folded_b`); 0 for a plain B. `x_slot_stride`: x holds every slot's
    shrink, slot s's at columns s * x_slot_stride on (the A-fold's GEMM output, lora/fold.py
    `a_fold_views`; of a many-slice module, its slices compact in the slot's block); 0 for the
    compact shrink of each row's own slot. `tiles` (BLOCK_N, warps[,
    "b-early"]) overrides EXPAND_TILES (benchmarks, tests). `use_pdl`: the backend's (Hopper, the
    intrinsics present); the launch is a programmatic dependent up to PDL_MAX_ROWS rows.
    """
    assert x.dim() == 2 and weights.dim() == 3, (x.shape, weights.shape)
    num_tokens = x.shape[0]
    _, out_dim, max_rank = weights.shape
    assert x.shape[1] >= num_slices * max_rank, (x.shape, num_slices, max_rank)
    # Every slot's shrink: slot s's block of x holds its slices compactly (slice k at k * rank), as
    # A's rows are (mem_pool), so the block must hold num_slices * max_rank columns.
    assert x_slot_stride == 0 or x_slot_stride >= num_slices * max_rank, (x_slot_stride, num_slices, max_rank)
    assert base_output.shape == (num_tokens, out_dim), (base_output.shape, num_tokens, out_dim)
    if slice_offsets is None:
        assert out_dim % num_slices == 0, (out_dim, num_slices)
        slice_width = out_dim // num_slices
        max_slice_width = slice_width
        offset_align = 1  # unused: equal slices are computed from an int the compiler sees
    else:
        assert slice_offsets.numel() == num_slices + 1, slice_offsets.shape
        assert max_slice_width is not None, "slice_offsets needs max_slice_width for the grid"
        slice_width = 0
        offset_align = qkv_offset_alignment(out_dim, max_slice_width) if num_slices == 3 else 1
    assert batch_info.permutation is not None, "csgmv expand needs batch_info.permutation"

    block_s = token_block(batch_info.max_len)
    block_n, num_warps, b_early = _plan(tiles or EXPAND_TILES)
    block_n = min(block_n, max(16, triton.next_power_of_2(max_slice_width)))
    block_r = rank_block(max_rank)
    n_tiles = triton.cdiv(max_slice_width, block_n)
    lanes, lane_iters = token_lanes(batch_info.max_len, block_s, n_tiles * num_slices)
    grid = (lanes * n_tiles, num_slices, batch_info.bs)
    if num_tokens == 0 or grid[0] == 0 or grid[2] == 0:
        return base_output  # eager only: graph-mode infos always have a non-empty grid
    offsets = slice_offsets if slice_offsets is not None else batch_info.seg_indptr  # unused then
    pdl = use_pdl and num_tokens <= PDL_MAX_ROWS
    _segment_expand_kernel[grid](
        x,
        weights,
        base_output,
        x.stride(0),
        x.stride(1),
        x_slot_stride,
        weights.stride(0),
        slice_stride,
        weights.stride(1),
        weights.stride(2),
        base_output.stride(0),
        base_output.stride(1),
        batch_info.seg_indptr,
        batch_info.weight_indices,
        batch_info.lora_ranks,
        batch_info.scalings,
        batch_info.permutation,
        offsets,
        slice_width,
        n_tiles,
        lanes,
        HAS_OFFSETS=slice_offsets is not None,
        OFFSET_ALIGN=offset_align,
        BLOCK_S=block_s,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        R_ITERS=triton.cdiv(max_rank, block_r),
        LANE_ITERS=lane_iters,
        DOT_PREC=dot_precision(weights),
        B_EARLY=b_early,
        USE_PDL=pdl,
        num_warps=num_warps,
        **({"launch_pdl": True} if pdl else {}),
    )
    return base_output


def _plan(tiles: tuple) -> tuple[int, int, bool]:
    """(BLOCK_N, warps, B loaded early) of a plan (BLOCK_N, warps[, "b-early"])."""
    assert len(tiles) in (2, 3) and (len(tiles) == 2 or tiles[2] == "b-early"), tiles
    return tiles[0], tiles[1], len(tiles) == 3


def qkv_offset_alignment(out_dim: int, max_slice_width: int) -> int:
    """A power of two (<= 16) dividing every offset of a qkv layout [0, q, q+kv, q+2kv].

    q and kv follow from the host-side shapes (out_dim = q + 2kv, max_slice_width = max(q, kv)):
    both readings (q the wider, as in GQA, or kv the wider) are folded in, so the hint holds for
    either. Without it the kernel cannot vectorise base_output's columns at loaded offsets.
    """
    candidates = [out_dim, max_slice_width]
    rest = out_dim - max_slice_width
    if rest > 0 and rest % 2 == 0:
        candidates.append(rest // 2)  # kv when q is the wider slice
    if out_dim - 2 * max_slice_width > 0:
        candidates.append(out_dim - 2 * max_slice_width)  # q when kv is the wider slice
    g = math.gcd(*candidates)
    return next(a for a in (16, 8, 4, 2, 1) if g % a == 0)
