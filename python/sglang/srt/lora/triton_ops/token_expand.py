"""Token-major LoRA expand: out[t, slice k] += scaling[slot(t)] * xa[t, k*r:(k+1)*r] @ B[slot(t), slice k, :r].T

Grid: (segments x column tiles of the widest slice, slices), like the token-major shrink: each
program takes one segment (lora/segments.py: up to BLOCK_S rows of one slot, through the
permutation), so it reads one adapter's B tile. Rows of rank-0 slots (the base model, padding) are
neither read nor written. Slices are equal (`slice_width`) or given by an int32 offsets tensor
(qkv under GQA: [0, q, q+kv, q+2kv]).

The base-output tile (the bytes that matter: a read-modify-write of out) is loaded before the
shrink's result is needed. With USE_PDL the kernel is launched as a programmatic dependent of the
shrink (Hopper and later): it may start while the shrink still runs, loads its tile, and waits
(`gdc_wait`) only before reading the shrink output. Every program waits, also those with nothing
to do, so the kernel never completes before the shrink it depends on.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sglang.srt.layers.triton_ops.common import gdc_wait
from sglang.srt.lora.triton_ops._token_rows import segment_rows, slice_columns


@triton.jit
def _expand_one_slot(
    xa_ptr,
    w_ptr,
    slot,
    rank,
    rows,
    row_mask,
    slice_id,
    offs_n,
    col_mask,
    xa_stride_t,
    w_stride_s,
    w_stride_n,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """xa[rows, slice cols] @ B[slot, offs_n, :rank].T for the rows in row_mask (others: 0)."""
    offs_r = tl.arange(0, BLOCK_R)
    # Slice k of the shrink output holds columns [k*rank, (k+1)*rank) (the compact prefix).
    xa_ptrs = xa_ptr + rows[:, None] * xa_stride_t + (slice_id * rank + offs_r)[None, :]
    w_ptrs = w_ptr + slot * w_stride_s + offs_n[None, :] * w_stride_n + offs_r[:, None]
    acc = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        r_mask = offs_r < rank - r0
        a = tl.load(xa_ptrs, mask=row_mask[:, None] & r_mask[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=r_mask[:, None] & col_mask[None, :], other=0.0)
        # In the weights' dtype: bf16 x bf16 keeps the tensor cores, as the shrink output would
        # have been rounded to bf16 anyway.
        acc = tl.dot(a.to(b.dtype), b, acc, input_precision=DOT_PREC)
        xa_ptrs += BLOCK_R
        w_ptrs += BLOCK_R
    return acc


@triton.jit
def _token_expand_kernel(
    xa_ptr,
    w_ptr,
    out_ptr,
    perm_ptr,
    seg_indptr_ptr,
    weight_indices_ptr,
    lora_ranks_ptr,
    scalings_ptr,
    slice_offsets_ptr,
    num_rows,
    slice_width,
    n_tiles,
    xa_stride_t,
    w_stride_s,
    w_stride_n,
    out_stride_t,
    HAS_OFFSETS: tl.constexpr,
    OFFSET_ALIGN: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PREC: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    slice_id = tl.program_id(1)
    tile_n = pid % n_tiles
    seg = pid // n_tiles
    col_lo, col_hi = slice_columns(slice_offsets_ptr, slice_id, slice_width, HAS_OFFSETS, OFFSET_ALIGN)
    offs_n = col_lo + tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = offs_n < col_hi  # narrower slices (kv under GQA) have idle column tiles
    rows, row_mask, active_rows, slot, rank = segment_rows(perm_ptr, seg_indptr_ptr, weight_indices_ptr, lora_ranks_ptr, seg,
                                              num_rows, BLOCK_S)
    mask = active_rows[:, None] & col_mask[None, :]
    out_ptrs = out_ptr + rows[:, None] * out_stride_t + offs_n[None, :]
    # Rows with nothing to add: the masked load reads nothing.
    base = tl.load(out_ptrs, mask=mask, other=0.0)
    if USE_PDL:
        gdc_wait()
    if tl.max(mask.to(tl.int32)) > 0:
        acc = _expand_one_slot(xa_ptr, w_ptr, slot, rank, rows, active_rows, slice_id, offs_n, col_mask,
                               xa_stride_t, w_stride_s, w_stride_n, BLOCK_S, BLOCK_N, BLOCK_R, DOT_PREC)
        scaling = tl.load(scalings_ptr + slot)
        result = base.to(tl.float32) + acc * scaling
        tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=mask)
