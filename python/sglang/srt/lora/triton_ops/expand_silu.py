"""An unfolded gate_up_proj's LoRA expand and the SiLU-and-mul after it, in one kernel (csgmv).

Unfolded (many slots, a high rank), gate_up_proj runs its base GEMM, then the segmented expand adds
each row's `scaling * xa @ B^T` into the GEMM's output in place (sgemm_lora_b.py), and then the
SiLU-and-mul reads that output again. The expand's read-modify-write of [T, 2d] costs 4 * T * 2d
bytes: at a 16 x 512 prefill on the Qwen3-4B shape, 637 MB per layer, most of the 11.7 ms the
expand took of a 130 ms step on 64 slots (H100). Here the program that computes a tile's delta
also applies the activation and writes only the activation's [T, d]: the gate_up output is read
once and never written back, and one launch per layer goes.

The roundings are the unfused path's, step for step: the delta is the expand's tensor-core dot over
the same tiles (rows of one segment, BLOCK_R-deep rank blocks, the B tile of the same columns),
added to the GEMM's output in float32 and rounded to the model dtype (what the expand stores), and
the activation is `silu_mul`, the SiLU-and-mul kernel's own code. Rows of rank-0 segments (base
requests, padding) get the plain activation. Every row of the batch is in exactly one segment
(lora/segments.py), so every row's activation is written; rows a graph's static segments list past
the batch's (its bucket's) row count are skipped.

Grid: (lanes x column tiles of d, segments). One program computes both halves (gate and up) of its
columns, so it needs both slices' B tiles: two dots per rank block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.srt.layers.triton_ops.common import dot_precision, interpreting
from sglang.srt.layers.triton_ops.silu_and_mul import silu_mul
from sglang.srt.lora.triton_ops._tiles import rank_block, token_block, token_lanes
from sglang.srt.lora.triton_ops._token_rows import segment_lane_start
from sglang.srt.lora.utils import LoRABatchInfo

# (BLOCK_N, num_warps): a program's columns of d (both halves: two B tiles and two accumulators of
# BLOCK_S x BLOCK_N) and its warps. The column tile changes no sum: each output's rank dot is the
# same. H100, Qwen3-4B, 64 slots, the kernel's µs per step at 256 -> 128 columns: prefill 2048
# 2,772 -> 2,679, 4x512 2,838 -> 2,661, 16x512 9,887 -> 9,350 (the expand's tile, 256, holds twice
# the accumulators here).
EXPAND_SILU_TILES = (128, 4)


@triton.jit
def _segment_expand_silu_kernel(
    x_ptr,
    w_ptr,
    gu_ptr,
    out_ptr,
    x_stride_t,
    x_stride_r,
    w_stride_s,
    w_stride_n,
    w_stride_r,
    gu_stride_t,
    out_stride_t,
    num_rows,
    seg_indptr_ptr,
    weight_indices_ptr,
    lora_ranks_ptr,
    scalings_ptr,
    perm_ptr,
    d,
    n_tiles,
    lanes,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    R_ITERS: tl.constexpr,
    LANE_ITERS: tl.constexpr,
    DOT_PREC: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
):
    seg = tl.program_id(1)
    slot = tl.load(weight_indices_ptr + seg)
    seg_end, tile_n, first_row = segment_lane_start(seg_indptr_ptr, seg, n_tiles, BLOCK_S)
    if first_row >= seg_end:  # empty segments (most of a graph bucket's)
        return
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = offs_n < d
    offs_r = tl.arange(0, BLOCK_R)
    # Slot -1 (no adapter) reads as rank 0: the rows get the plain activation.
    rank = tl.where(slot >= 0, tl.load(lora_ranks_ptr + tl.maximum(slot, 0)), 0)
    scaling = tl.load(scalings_ptr + tl.maximum(slot, 0))
    # gate rows of B are [0, d), up rows [d, 2d) (equal slices, no offsets).
    wg_base = w_ptr + tl.maximum(slot, 0).to(tl.int64) * w_stride_s + offs_n[None, :].to(tl.int64) * w_stride_n
    wu_base = wg_base + d * w_stride_n

    for it in tl.static_range(LANE_ITERS):
        row0 = first_row + it * lanes * BLOCK_S
        if row0 < seg_end:
            offs_s = row0 + tl.arange(0, BLOCK_S)
            rows = tl.load(perm_ptr + offs_s, mask=offs_s < seg_end, other=num_rows).to(tl.int64)
            # A graph's static segments run on past its bucket (their inactive run covers the
            # largest bucket's rows): rows past this batch are not there. (The expand never meets
            # them: they are rank-0 rows, which it skips; here every row is written.)
            row_mask = rows < num_rows
            mask = row_mask[:, None] & col_mask[None, :]
            g_ptrs = gu_ptr + rows[:, None] * gu_stride_t + offs_n[None, :]
            gate = tl.load(g_ptrs, mask=mask, other=0.0)
            up = tl.load(g_ptrs + d, mask=mask, other=0.0)
            if rank > 0:
                # Slice k of the shrink output holds columns [k*rank, (k+1)*rank) (compact prefix).
                xg_ptrs = x_ptr + rows[:, None] * x_stride_t + offs_r[None, :] * x_stride_r
                xu_ptrs = xg_ptrs + rank * x_stride_r
                wg_ptrs = wg_base + offs_r[:, None] * w_stride_r
                wu_ptrs = wu_base + offs_r[:, None] * w_stride_r
                acc_g = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
                acc_u = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
                for ri in tl.static_range(R_ITERS):
                    # K is clipped to the slot's rank: columns past it may hold stale data.
                    r_mask = offs_r < rank - ri * BLOCK_R
                    a_mask = row_mask[:, None] & r_mask[None, :]
                    b_mask = r_mask[:, None] & col_mask[None, :]
                    bg = tl.load(wg_ptrs, mask=b_mask, other=0.0)
                    bu = tl.load(wu_ptrs, mask=b_mask, other=0.0)
                    ag = tl.load(xg_ptrs, mask=a_mask, other=0.0)
                    au = tl.load(xu_ptrs, mask=a_mask, other=0.0)
                    acc_g = tl.dot(ag.to(bg.dtype), bg, acc_g, input_precision=DOT_PREC)
                    acc_u = tl.dot(au.to(bu.dtype), bu, acc_u, input_precision=DOT_PREC)
                    xg_ptrs += BLOCK_R * x_stride_r
                    xu_ptrs += BLOCK_R * x_stride_r
                    wg_ptrs += BLOCK_R * w_stride_r
                    wu_ptrs += BLOCK_R * w_stride_r
                # What the expand would have stored into gate_up's output.
                gate = (gate.to(tl.float32) + acc_g * scaling).to(gate.dtype)
                up = (up.to(tl.float32) + acc_u * scaling).to(up.dtype)
            out_ptrs = out_ptr + rows[:, None] * out_stride_t + offs_n[None, :]
            tl.store(out_ptrs, silu_mul(gate, up, out_ptr.dtype.element_ty, EMULATE_RNE), mask=mask)


def segmented_expand_silu(
    x: torch.Tensor,
    weights: torch.Tensor,
    batch_info: LoRABatchInfo,
    gate_up: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """out [T, d] <- silu(gate + delta_g) * (up + delta_u), gate_up [T, 2d] the base GEMM's output
    (read only), delta = each row's scaling * x[:, k*r:(k+1)*r] @ B[slot, k*d:(k+1)*d, :r]^T with x
    [T, >= 2 * max_rank] gate_up's compact, unscaled shrink and B `weights` [S, 2d, max_rank].
    `out` may have any row stride (e.g. the first d columns of down_proj's x_aug); it must not
    overlap x or gate_up."""
    assert x.dim() == 2 and weights.dim() == 3 and gate_up.dim() == 2, (x.shape, weights.shape, gate_up.shape)
    num_tokens, two_d = gate_up.shape
    _, out_dim, max_rank = weights.shape
    d = two_d // 2
    assert out_dim == two_d and two_d % 2 == 0, (weights.shape, gate_up.shape)
    assert x.shape[0] == num_tokens and x.shape[1] >= 2 * max_rank, (x.shape, max_rank)
    assert out.shape == (num_tokens, d) and out.stride(1) == 1 and gate_up.stride(1) == 1, (out.shape, out.stride())
    assert out.dtype == gate_up.dtype, (out.dtype, gate_up.dtype)
    assert batch_info.permutation is not None, "the segmented kernels need batch_info.permutation"
    block_s = token_block(batch_info.max_len)
    block_n = min(EXPAND_SILU_TILES[0], max(16, triton.next_power_of_2(d)))
    block_r = rank_block(max_rank)
    n_tiles = triton.cdiv(d, block_n)
    lanes, lane_iters = token_lanes(batch_info.max_len, block_s, n_tiles)
    grid = (lanes * n_tiles, batch_info.bs)
    if num_tokens == 0 or grid[0] == 0 or grid[1] == 0:
        return out  # eager only: graph-mode infos always have a non-empty grid
    _segment_expand_silu_kernel[grid](
        x,
        weights,
        gate_up,
        out,
        x.stride(0),
        x.stride(1),
        weights.stride(0),
        weights.stride(1),
        weights.stride(2),
        gate_up.stride(0),
        out.stride(0),
        num_tokens,
        batch_info.seg_indptr,
        batch_info.weight_indices,
        batch_info.lora_ranks,
        batch_info.scalings,
        batch_info.permutation,
        d,
        n_tiles,
        lanes,
        BLOCK_S=block_s,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        R_ITERS=triton.cdiv(max_rank, block_r),
        LANE_ITERS=lane_iters,
        DOT_PREC=dot_precision(weights),
        EMULATE_RNE=interpreting(),
        num_warps=EXPAND_SILU_TILES[1],
    )
    return out
