"""The shrink of a folded module at long prefills as one cuBLAS GEMM over every slot's A, then a pack.

shrink_pack (shrink_pack.py) reduces each segment's rows against its own slot's A: 16 rows a
segment, split-K, a ticket per tile. At a long prefill that is thousands of tiny programs, bound by
their latency rather than by bytes (H200, Qwen3-4B qkv_proj at 2,048 rows: 33 µs, where reading x
once takes ~2 µs). Here the shrink is instead

    y [T, S*c*R] = x @ A_all^T        A_all = the S adapter slots' A [S, c*R, K] as [S*c*R, K]

one dense GEMM that computes every row against every slot (S times the FLOPs a row needs, which
at S*c*R <= GEMM_SHRINK_MAX_COLS stays a few GFLOPs), and then `_pack_all_slots_kernel` writes
x_aug's E columns from y: a row's own slot's block gets `scaling * y` (slice k's compact columns
k*r + j of the slot's part of y go to k*R + j), every other column zero, as shrink_pack's layout
has it. x is x_aug's own first K columns (the norm or activation before the module wrote them:
SGLANG_LORA_PACK_IN_PLACE), so nothing else is written.

The values are rounded once more than shrink_pack's (y is bf16, then scaled), as the A-fold's
shrink is (its GEMM output, scaled by the expand). Which path a batch takes is a function of its
graph bucket (the backend's `gemm_shrink_min_tokens`), so a graph replay and an eager pass of a
batch compute the same way; the pack reads one row at a time, so a row's values do not depend on
which rows share its tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.srt.lora.triton_ops._token_rows import segment_rows

# Widest y (S*c*R columns) the GEMM shrink takes: 8 slots of rank 16 on qkv are 384, 16 slots 768,
# 8 slots of rank 64 1,536 (the widest measured: there it still halves shrink_pack's time from
# 1,024 rows on, H100); past it the GEMM's S-fold FLOPs may outgrow shrink_pack's latency.
GEMM_SHRINK_MAX_COLS = 1536
# Most adapter slots: the GEMM does S times the shrink's work, shrink_pack its own slot's only.
# H100 (bench_gemm_shrink.py, µs at 1,024 / 2,048 rows): with 16 slots qkv_proj and gate_up_proj
# win (Qwen3-4B qkv 16.2 -> 13.0 / 24.8 -> 18.4) but a one-slice module over a long K does not
# (down_proj, K = 9,728 / 14,336: 16.6 -> 20.0 / 31.6 -> 30.1 on Qwen3-4B, 19.8 -> 27.3 / 40.5 ->
# 39.5 on the 8B), where with 8 slots it wins (16.6 -> 13.1, 19.8 -> 16.9). Hence 16 slots for
# modules of several slices, 8 for one.
GEMM_SHRINK_MAX_SLOTS = 16


def gemm_shrink_max_slots(stack: int) -> int:
    """Most adapter slots the GEMM shrink takes for a module of `stack` output slices."""
    return GEMM_SHRINK_MAX_SLOTS if stack > 1 else GEMM_SHRINK_MAX_SLOTS // 2


@triton.jit
def _pack_all_slots_kernel(
    y_ptr,
    xaug_ptr,
    perm_ptr,
    seg_indptr_ptr,
    weight_indices_ptr,
    lora_ranks_ptr,
    scalings_ptr,
    num_rows,
    y_stride_t,
    xaug_stride_t,
    K,
    STACK: tl.constexpr,
    MAX_RANK: tl.constexpr,
    E_COLS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    seg = tl.program_id(0)
    stripe = tl.program_id(1)
    rows, row_mask, active_rows, slot, rank = segment_rows(perm_ptr, seg_indptr_ptr, weight_indices_ptr,
                                                           lora_ranks_ptr, seg, num_rows, BLOCK_S)
    if tl.load(seg_indptr_ptr + seg) >= tl.load(seg_indptr_ptr + seg + 1):
        return  # an empty segment (past the live batch's)
    block_w: tl.constexpr = STACK * MAX_RANK
    cols = stripe * BLOCK_E + tl.arange(0, BLOCK_E)
    within = cols % block_w
    k_slice = within // MAX_RANK
    j = within % MAX_RANK
    # Rank 0 (the base model, padding, an empty slot): no column is a value.
    is_value = ((cols // block_w) == slot) & (j < rank) & (cols < E_COLS)
    # The slot's part of y holds the compact shrink: slice k's column j at k*r + j.
    y_cols = tl.maximum(slot, 0) * block_w + k_slice * rank + j
    y = tl.load(y_ptr + rows[:, None] * y_stride_t + y_cols[None, :],
                mask=active_rows[:, None] & is_value[None, :], other=0.0)
    scaling = tl.load(scalings_ptr + tl.maximum(slot, 0))
    out = tl.where(is_value[None, :], y.to(tl.float32) * scaling, 0.0)
    tl.store(xaug_ptr + rows[:, None] * xaug_stride_t + K + cols[None, :], out.to(xaug_ptr.dtype.element_ty),
             mask=row_mask[:, None] & (cols < E_COLS)[None, :])


def gemm_shrink_fits(A: torch.Tensor) -> bool:
    """Whether A [slots, c*R, K]'s rows lie at one stride (so its slots read as one matrix)."""
    return A.stride(2) == 1 and A.stride(0) == A.shape[1] * A.stride(1)


def gemm_shrink_width(num_fold_slots: int, stack: int, max_rank: int) -> int:
    """Columns of y for a module: every adapter slot's c*R block."""
    return num_fold_slots * stack * max_rank


def gemm_shrink_pack(
    x_aug: torch.Tensor,
    in_dim: int,
    A: torch.Tensor,
    y: torch.Tensor,
    perm: torch.Tensor,
    seg_indptr: torch.Tensor,
    weight_indices: torch.Tensor,
    lora_ranks: torch.Tensor,
    scalings: torch.Tensor,
    stack: int,
    max_rank: int,
    num_fold_slots: int,
    num_segments: int,
    block_s: int,
) -> torch.Tensor:
    """Write x_aug[:, in_dim:] = each row's packed pre-scaled shrink (x is x_aug[:, :in_dim]).

    `A` [slots, c*R, K] (the adapter slots first, the base model's last, as the pool has them),
    `y` a scratch [T, S*c*R] (S = `num_fold_slots`), `num_segments` the grid's segment axis
    (a graph bucket's capacity or the batch's count). Returns x_aug."""
    rows, width = x_aug.shape
    e_cols = width - in_dim
    cols = gemm_shrink_width(num_fold_slots, stack, max_rank)
    assert A.shape[1] == stack * max_rank and A.shape[2] == in_dim and A.shape[0] >= num_fold_slots, A.shape
    assert gemm_shrink_fits(A), A.stride()
    assert y.shape == (rows, cols) and y.is_contiguous(), (y.shape, rows, cols)
    assert e_cols >= cols, (e_cols, cols)
    if rows == 0 or num_segments == 0:
        return x_aug
    # A's rows as one [S*c*R, K] matrix: the pool's own buffer, or the rows past W inside W_aug's
    # buffer (an A-folded module's A, row stride K + E).
    a_all = A.as_strided((cols, in_dim), (A.stride(1), 1), A.storage_offset())
    torch.mm(x_aug[:, :in_dim], a_all.t(), out=y)
    block_e = min(256, triton.next_power_of_2(e_cols))
    grid = (num_segments, triton.cdiv(e_cols, block_e))
    _pack_all_slots_kernel[grid](
        y, x_aug, perm, seg_indptr, weight_indices, lora_ranks, scalings, rows, y.stride(0), x_aug.stride(0),
        in_dim, STACK=stack, MAX_RANK=max_rank, E_COLS=e_cols, BLOCK_S=block_s, BLOCK_E=block_e, num_warps=4,
    )
    return x_aug
