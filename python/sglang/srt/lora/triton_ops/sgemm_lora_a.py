"""Segmented LoRA shrink: out[t, :c*r] = x[t] @ A[slot, :c*r].T for every token of every segment.

One kernel serves both backends. `triton` walks tokens in their natural order (a segment is one
request); `csgmv` walks adapter-sorted positions and gathers rows through `batch_info.permutation`
(PERMUTED=True), writing results back to the same token rows, so the shrink output is always in
token order and either expand can consume it.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sglang.srt.lora.triton_ops._tiles import dot_precision, rank_block, token_lanes
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
    k_per_split,
    STACK: tl.constexpr,
    PERMUTED: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_ITERS: tl.constexpr,
    LANE_ITERS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    # Slot and rank first: base requests, padding and unused graph segments leave here.
    seg = tl.program_id(1)
    slot = tl.load(weight_indices_ptr + seg)
    rank = tl.load(lora_ranks_ptr + slot)
    if rank == 0:
        return
    seg_start = tl.load(seg_indptr_ptr + seg)
    seg_end = tl.load(seg_indptr_ptr + seg + 1)
    pid = tl.program_id(0)
    split = pid % SPLIT_K
    pid = pid // SPLIT_K
    tile_n = pid % n_tiles
    lane = pid // n_tiles
    first_row = seg_start + lane * BLOCK_S
    if first_row >= seg_end:  # also covers empty segments
        return
    n_cols = STACK * rank  # the adapter's compact prefix: c slices of r rows each
    col0 = tile_n * BLOCK_N
    if col0 >= n_cols:
        return

    offs_n = col0 + tl.arange(0, BLOCK_N)
    col_mask = offs_n < n_cols
    # Split-K: this program reduces K range [k_lo, k_hi) (all of K when SPLIT_K == 1).
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    offs_k = k_lo + tl.arange(0, BLOCK_K)
    w_base = w_ptr + slot.to(tl.int64) * w_stride_s + offs_n[None, :].to(tl.int64) * w_stride_n

    # This lane's token tiles: first_row + i * lanes * BLOCK_S, skipped past the segment end.
    for it in range(LANE_ITERS):
        row0 = first_row + it * lanes * BLOCK_S
        if row0 < seg_end:
            offs_s = row0 + tl.arange(0, BLOCK_S)
            row_mask = offs_s < seg_end
            if PERMUTED:
                rows = tl.load(perm_ptr + offs_s, mask=row_mask, other=0).to(tl.int64)
            else:
                rows = offs_s.to(tl.int64)
            x_ptrs = x_ptr + rows[:, None] * x_stride_t + offs_k[None, :] * x_stride_k
            w_ptrs = w_base + offs_k[:, None] * w_stride_k
            acc = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
            for kk in range(K_ITERS):
                k_mask = offs_k < k_hi - kk * BLOCK_K
                a = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                b = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
                acc = tl.dot(a, b.to(a.dtype), acc, input_precision=DOT_PREC)
                x_ptrs += BLOCK_K * x_stride_k
                w_ptrs += BLOCK_K * w_stride_k

            out_ptrs = out_ptr + rows[:, None] * out_stride_t + offs_n[None, :] * out_stride_n
            mask = row_mask[:, None] & col_mask[None, :]
            if SPLIT_K == 1:
                tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
            else:
                # Partial sums meet in a zero-initialised fp32 output.
                tl.atomic_add(out_ptrs, acc, mask=mask)


# Shrink tiles: 16-row tiles keep many programs in flight over x (the bytes that matter; the
# narrow A tile is re-read from L2), and deep K tiles amortise the reduction loop.
_SHRINK_BLOCK_S = 16
# Split K when the dense tiling of x has fewer programs than this (decode, short prefills).
_SPLIT_TARGET_PROGRAMS = 512
_MAX_SPLIT_K = 8


def shrink_split_k(num_tokens: int, n_tiles: int, k_blocks: int) -> int:
    """How many programs share one tile's K reduction.

    The shrink's output is narrow (stack*rank columns), so with few token tiles each program
    would walk all of K (up to the MLP's intermediate size) alone, latency-bound. The estimate
    uses the row count of x, a static shape under graphs.
    """
    programs = triton.cdiv(max(num_tokens, 1), _SHRINK_BLOCK_S) * n_tiles
    if programs >= _SPLIT_TARGET_PROGRAMS or k_blocks < 4:
        return 1
    return max(1, min(_MAX_SPLIT_K, k_blocks // 2, _SPLIT_TARGET_PROGRAMS // programs))


def segmented_shrink(
    x: torch.Tensor,
    weights: torch.Tensor,
    batch_info: LoRABatchInfo,
    stack_num: int,
    permuted: bool,
    out: Optional[torch.Tensor] = None,
    split_k: Optional[int] = None,
) -> torch.Tensor:
    """Launch the shrink over `batch_info`'s grid. Returns `out` [T, stack_num * R].

    With `out` given, only the live block (active rows, columns < stack*rank) is written and
    nothing else changes. Without it, the result is allocated here: in x's dtype when K is
    reduced by one program, or zero-initialised fp32 when split-K partial sums are accumulated
    atomically (few token tiles over a long K: decode, short prefills, csgmv with few chunks).
    Columns >= stack*rank are never read by the expand kernels either way.
    """
    assert x.dim() == 2 and weights.dim() == 3, (x.shape, weights.shape)
    num_tokens, in_dim = x.shape
    _, stacked_rank, w_in_dim = weights.shape
    assert w_in_dim == in_dim, f"LoRA A expects in_dim {w_in_dim}, got x with {in_dim}"
    assert stacked_rank % stack_num == 0, (stacked_rank, stack_num)
    if permuted:
        assert batch_info.permutation is not None, "csgmv shrink needs batch_info.permutation"

    block_s = _SHRINK_BLOCK_S
    block_n = rank_block(stacked_rank)
    # 256-deep K tiles for 16-bit inputs; fp32 tiles are twice the bytes, so half as deep.
    block_k = min(256 if x.element_size() <= 2 else 128, max(16, triton.next_power_of_2(in_dim)))
    n_tiles = triton.cdiv(stacked_rank, block_n)
    k_blocks = triton.cdiv(in_dim, block_k)
    if split_k is None:
        split_k = 1 if out is not None else shrink_split_k(num_tokens, n_tiles, k_blocks)
    split_k = max(1, min(split_k, k_blocks))
    k_per_split = triton.cdiv(k_blocks, split_k) * block_k
    split_k = triton.cdiv(in_dim, k_per_split)  # no empty splits

    if out is None:
        if split_k > 1:
            out = torch.zeros((num_tokens, stacked_rank), dtype=torch.float32, device=x.device)
        else:
            out = torch.empty((num_tokens, stacked_rank), dtype=x.dtype, device=x.device)
    assert out.shape == (num_tokens, stacked_rank), (out.shape, num_tokens, stacked_rank)
    assert split_k == 1 or out.dtype == torch.float32, "split-K accumulates into fp32"

    lanes, lane_iters = token_lanes(batch_info.max_len, block_s, n_tiles * split_k)
    grid = (lanes * n_tiles * split_k, batch_info.bs)
    if num_tokens == 0 or grid[0] == 0 or grid[1] == 0:
        return out  # eager only: graph-mode infos always have a non-empty grid
    perm = batch_info.permutation if permuted else batch_info.seg_indptr  # unused when not permuted
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
        perm,
        n_tiles,
        lanes,
        k_per_split,
        STACK=stack_num,
        PERMUTED=permuted,
        BLOCK_S=block_s,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        K_ITERS=k_per_split // block_k,
        LANE_ITERS=lane_iters,
        SPLIT_K=split_k,
        DOT_PREC=dot_precision(x, weights),
        num_warps=4,
    )
    return out


def sgemm_lora_a_fwd(
    x: torch.Tensor,
    weights: torch.Tensor,
    batch_info: LoRABatchInfo,
    stack_num: int = 1,
    out: Optional[torch.Tensor] = None,
    split_k: Optional[int] = None,
) -> torch.Tensor:
    """Shrink for the `triton` backend (one segment per request, natural token order)."""
    return segmented_shrink(x, weights, batch_info, stack_num, permuted=False, out=out, split_k=split_k)
