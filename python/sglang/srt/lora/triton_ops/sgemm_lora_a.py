"""Segmented LoRA shrink: out[t, :c*r] = x[t] @ A[slot, :c*r].T for every token of every segment.

`csgmv`'s unfolded modules walk adapter-sorted positions and gather rows through
`batch_info.permutation`, writing results back to the same token rows, so the shrink output is in
token order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.srt.lora.triton_ops._token_rows import segment_lane_start, segment_slot_rank
from sglang.srt.layers.triton_ops.common import dot_precision
from sglang.srt.lora.triton_ops._tiles import rank_block, token_lanes
from sglang.srt.lora.utils import LoRABatchInfo


@triton.jit
def _segment_shrink_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    K,
    x_stride_t,
    x_stride_k,
    w_stride_s,
    w_stride_n,
    w_stride_k,
    out_stride_t,
    out_stride_n,
    seg_indptr_ptr,
    weight_indices_ptr,
    lora_ranks_ptr,
    perm_ptr,
    n_tiles,
    lanes,
    STACK: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_ITERS: tl.constexpr,
    LANE_ITERS: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    # Slot and rank first: base requests, padding and unused graph segments leave here.
    seg = tl.program_id(1)
    slot, rank = segment_slot_rank(weight_indices_ptr, lora_ranks_ptr, seg)
    if rank == 0:
        return
    seg_end, tile_n, first_row = segment_lane_start(seg_indptr_ptr, seg, n_tiles, BLOCK_S)
    if first_row >= seg_end:  # also covers empty segments
        return
    n_cols = STACK * rank  # the adapter's compact prefix: c slices of r rows each
    col0 = tile_n * BLOCK_N
    if col0 >= n_cols:
        return

    offs_n = col0 + tl.arange(0, BLOCK_N)
    col_mask = offs_n < n_cols
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + slot.to(tl.int64) * w_stride_s + offs_n[None, :].to(tl.int64) * w_stride_n

    # This lane's token tiles: first_row + i * lanes * BLOCK_S, skipped past the segment end.
    for it in range(LANE_ITERS):
        row0 = first_row + it * lanes * BLOCK_S
        if row0 < seg_end:
            offs_s = row0 + tl.arange(0, BLOCK_S)
            row_mask = offs_s < seg_end
            rows = tl.load(perm_ptr + offs_s, mask=row_mask, other=0).to(tl.int64)
            x_ptrs = x_ptr + rows[:, None] * x_stride_t + offs_k[None, :] * x_stride_k
            w_ptrs = w_base + offs_k[:, None] * w_stride_k
            acc = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
            for kk in range(K_ITERS):
                k_mask = offs_k < K - kk * BLOCK_K
                a = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                b = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
                acc = tl.dot(a, b.to(a.dtype), acc, input_precision=DOT_PREC)
                x_ptrs += BLOCK_K * x_stride_k
                w_ptrs += BLOCK_K * w_stride_k

            out_ptrs = out_ptr + rows[:, None] * out_stride_t + offs_n[None, :] * out_stride_n
            mask = row_mask[:, None] & col_mask[None, :]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# Shrink tiles: 16-row tiles keep many programs in flight over x (the bytes that matter; the
# narrow A tile is re-read from L2), and deep K tiles amortise the reduction loop.
_SHRINK_BLOCK_S = 16


def segmented_shrink(
    x: torch.Tensor,
    weights: torch.Tensor,
    batch_info: LoRABatchInfo,
    stack_num: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """Launch the shrink over `batch_info`'s grid into `out` [T, stack_num * R] and return it.

    Only the live block (active rows, columns < stack*rank) is written; nothing else changes, and
    the expand kernels read nothing else. Each program reduces all of K for its rows (no split:
    a fixed summation order, whatever the batch), so results do not depend on the launch shape.
    """
    assert x.dim() == 2 and weights.dim() == 3, (x.shape, weights.shape)
    num_tokens, in_dim = x.shape
    _, stacked_rank, w_in_dim = weights.shape
    assert w_in_dim == in_dim, f"LoRA A expects in_dim {w_in_dim}, got x with {in_dim}"
    assert stacked_rank % stack_num == 0, (stacked_rank, stack_num)
    assert out.shape == (num_tokens, stacked_rank), (out.shape, num_tokens, stacked_rank)
    assert batch_info.permutation is not None, "csgmv shrink needs batch_info.permutation"

    block_s = _SHRINK_BLOCK_S
    block_n = rank_block(stacked_rank)
    # 256-deep K tiles for 16-bit inputs; fp32 tiles are twice the bytes, so half as deep.
    block_k = min(256 if x.element_size() <= 2 else 128, max(16, triton.next_power_of_2(in_dim)))
    n_tiles = triton.cdiv(stacked_rank, block_n)

    lanes, lane_iters = token_lanes(batch_info.max_len, block_s, n_tiles)
    grid = (lanes * n_tiles, batch_info.bs)
    if num_tokens == 0 or grid[0] == 0 or grid[1] == 0:
        return out  # eager only: graph-mode infos always have a non-empty grid
    _segment_shrink_kernel[grid](
        x,
        weights,
        out,
        in_dim,
        x.stride(0),
        x.stride(1),
        weights.stride(0),
        weights.stride(1),
        weights.stride(2),
        out.stride(0),
        out.stride(1),
        batch_info.seg_indptr,
        batch_info.weight_indices,
        batch_info.lora_ranks,
        batch_info.permutation,
        n_tiles,
        lanes,
        STACK=stack_num,
        BLOCK_S=block_s,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        K_ITERS=triton.cdiv(in_dim, block_k),
        LANE_ITERS=lane_iters,
        DOT_PREC=dot_precision(x, weights),
        num_warps=4,
    )
    return out
