"""A folded module's GEMM for a decode batch of one row, reading only that row's adapter block.

A folded module (lora/fold.py) runs one cuBLAS GEMM `x_aug @ W_aug^T` over W_aug [N, K + E], where
E = S*c*R holds the B of every adapter slot. At decode batch 1 the GEMM is a GEMV bound by the
weight bytes, and a row uses one slot at most, so cuBLAS reads S*c*R columns of which at most c*R
(of one slot) can be non-zero: on the Qwen3-4B shape with 8 slots of rank 16, 4.7 MB of qkv_proj's
31 MB and 10 MB of gate_up_proj's 100 MB in every layer. Here one program per BLOCK_N output rows
streams W's K columns, then reads the row's slot block (its slot from the batch's `row_slots`, on
the device, so a graph replays it for whatever adapter the row has) and skips the other slots.
The base model's slot and idle rows (-1) have no block.

The result is the folded GEMM's, summed in another order (fp32 over BLOCK_K tiles, then the slot
block; cuBLAS's order is its own). The backend takes this kernel for every one-row decode batch
whose rows carry their slot (the fused norms' row_slots), in graphs and eager alike, so a replay
equals an eager pass bit for bit.

bench_gemv.py --fold-slots 8 (H100, 2026-12-07, µs per call, weights past L2), this kernel's GEMV
over W against cuBLAS over W_aug: Qwen3-4B qkv_proj 16.4 / 18.8, gate_up_proj 43.1 / 46.5;
Llama-3.1-8B 23.8 / 26.3 and 84.3 / 91.0. On W alone the two were within 1-4% of each other.
Whole one-request decode steps (profile_forward, the same H100): LoRA / base 1.11 -> 1.10 on
Qwen3-4B, 1.06 -> 1.04 on Llama-3.1-8B.

The A-fold (`a_fold_gemv`, SGLANG_LORA_AFOLD_GEMV, on by default): an A-folded
o_proj / down_proj runs `x @ [W; A of every slot]^T`, the base output and every slot's shrink,
of which the fused norm after it reads the row's own slot block only. The same kernel then reads
W's rows and the row's slot's R rows of A, and writes zeros for the other slots' shrink columns
(their A is never read): 7 of 8 slots' A is 0.9 MB a layer on the Qwen3-4B o_proj, 2.2 MB on its
down_proj. bench_gemv.py measured this GEMV over W alone at 0.91-0.93 of cuBLAS on both models'
o_proj and 0.97-1.01 on their down_proj (H100, 2026-12-07). In a one-request Qwen3-4B step with
8 slots it took 107 µs of GPU time and 71 kernels off (cuBLAS's split-K GEMMs and their reduces):
LoRA / base 1.14 -> 1.11 (profile_forward, the default against variant lora-no-afold-gemv, the
same H100 day).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sglang.srt.layers.triton_ops.common import dot_precision
from sglang.srt.layers.triton_ops.gemv import dot_k, gemv_config


@triton.jit
def _fold_gemv_kernel(
    x_ptr,  # x_aug [1, K + E] (A_ROWS: x [1, K])
    w_ptr,  # W_aug [N, K + E] (A_ROWS: [W; A of every slot] [N_base + S*R, K]), unit column stride
    bias_ptr,
    y_ptr,  # [1, N]
    slot_ptr,  # the row's slot: row_slots[0]
    N,
    K,
    stride_w,
    num_blocks,  # slots with a block in W_aug (the base model's has none)
    n_base,  # A_ROWS: the rows of W, before the slots' A
    BLOCK_COLS: tl.constexpr,  # a slot block: c*R columns of W_aug (A_ROWS: R rows of A)
    LORA_TILE: tl.constexpr,  # BLOCK_COLS rounded up to a power of two, at least 16
    A_ROWS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,  # common.dot_precision's
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # The slot loads first, so its latency hides behind the K loop.
    slot = tl.load(slot_ptr)
    has_block = (slot >= 0) & (slot < num_blocks)
    # tl.dot needs 16 rows: the live row is row 0, the others are masked loads of zero.
    offs_b = tl.arange(0, 16)
    b_mask = offs_b < 1
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    if A_ROWS:
        # W's rows, and of the A rows past them the row's slot's only; the others stay zero. A row
        # without a block takes slot -1, whose "A rows" [-R, 0) are W's last rows: read anyway.
        a_slot = tl.where(has_block, slot, -1)
        a_row = offs_n - n_base
        read = n_mask & ((offs_n < n_base) | ((a_row >= a_slot * BLOCK_COLS) & (a_row < (a_slot + 1) * BLOCK_COLS)))
    else:
        read = n_mask
    w_rows = w_ptr + offs_n.to(tl.int64)[None, :] * stride_w
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    if A_ROWS:
        if tl.max(read.to(tl.int32), axis=0) > 0:  # a program of other slots' A rows reads nothing
            acc = dot_k(x_ptr, w_rows, acc, read, K, offs_b, b_mask, PRECISION, BLOCK_K)
    else:
        acc = dot_k(x_ptr, w_rows, acc, read, K, offs_b, b_mask, PRECISION, BLOCK_K)
        if has_block:  # the row's slot block of x_aug's extra columns; the other slots' are skipped
            col0 = K + slot * BLOCK_COLS
            offs_r = tl.arange(0, LORA_TILE)
            r_mask = offs_r < BLOCK_COLS
            x = tl.load(x_ptr + col0 + offs_r[None, :] + offs_b[:, None] * 0, mask=b_mask[:, None] & r_mask[None, :],
                        other=0.0)
            w = tl.load(w_rows + col0 + offs_r[:, None], mask=r_mask[:, None] & n_mask[None, :], other=0.0)
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_b[:, None] * 0 + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=b_mask[:, None] & n_mask[None, :])


def _launch(x: torch.Tensor, w: torch.Tensor, k: int, slot: torch.Tensor, num_blocks: int, block: int,
            bias: Optional[torch.Tensor], n_base: int, a_rows: bool) -> torch.Tensor:
    assert x.dim() == 2 and x.shape[0] == 1 and x.stride(1) == 1, x.shape
    assert w.stride(1) == 1, w.stride()
    assert slot.dtype == torch.int32 and slot.numel() >= 1, slot
    n = w.shape[0]
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    # The configuration of a plain GEMV over W (the slots' part is a few columns or rows more).
    block_n, block_k, warps, stages = gemv_config(n_base if a_rows else n, k)
    _fold_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w, bias if bias is not None else y, y, slot, n, k, w.stride(0), num_blocks, n_base,
        BLOCK_COLS=block, LORA_TILE=max(16, triton.next_power_of_2(block)), A_ROWS=a_rows, HAS_BIAS=bias is not None,
        PRECISION=dot_precision(x), BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages)
    return y


def fold_gemv(x_aug: torch.Tensor, w_aug: torch.Tensor, in_dim: int, slot: torch.Tensor, num_blocks: int,
              block_cols: int, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`F.linear(x_aug, w_aug, bias)` for one row whose adapter slot is `slot` (an int32 tensor of one
    element on the device): W_aug's first `in_dim` columns and the slot's `block_cols` columns at
    `in_dim + slot * block_cols`, the other slots skipped (their x_aug columns are zero for this row)."""
    assert w_aug.shape[1] == x_aug.shape[1], (w_aug.shape, x_aug.shape)
    assert in_dim + num_blocks * block_cols <= w_aug.shape[1], (in_dim, num_blocks, block_cols, w_aug.shape)
    return _launch(x_aug, w_aug, in_dim, slot, num_blocks, block_cols, bias, 0, False)


def a_fold_gemv(x: torch.Tensor, w_a: torch.Tensor, n_base: int, slot: torch.Tensor, block_rows: int) -> torch.Tensor:
    """`F.linear(x, w_a)` for one row whose adapter slot is `slot`, where w_a = [W; A of every slot]
    [n_base + S*block_rows, K] (lora/fold.py's a_fold_views): W's rows and the slot's `block_rows`
    rows of A; the other slots' shrink columns are zeros (the fused norm after the module reads the
    row's own slot block only)."""
    assert x.shape[1] == w_a.shape[1], (x.shape, w_a.shape)
    num_blocks, rest = divmod(w_a.shape[0] - n_base, block_rows)
    assert num_blocks >= 0 and rest == 0, (w_a.shape, n_base, block_rows)
    return _launch(x, w_a, x.shape[1], slot, num_blocks, block_rows, None, n_base, True)
