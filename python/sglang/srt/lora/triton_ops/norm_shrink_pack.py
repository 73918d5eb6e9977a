"""RMSNorm (residual add fused) and a folded module's shrink_pack in one kernel, for decode.

A folded module (shrink_pack.py, lora/fold.py) needs `x_aug = [x | packed pre-scaled shrink]`,
and the x of qkv_proj and gate_up_proj is an RMSNorm's output. Run apart, a decode step pays two
dependent kernels per module: the norm, then shrink_pack (its launch and the idle GPU between
them inside the graph: ~10 µs per module on an H200, most of a LoRA decode step's excess). This
kernel writes the norm's output straight into `x_aug[:, :K]` and the row's shrink into its slot's
block, so the module's GEMM follows the norm directly.

Grid: rows x column tiles of the stacked rank. Every program normalises its row in registers (the
same code and roundings as layers/triton_ops/rmsnorm.py, so `x_aug[:, :K]` equals `rmsnorm_fwd`'s
output bit for bit) and reduces BLOCK_J columns of its row's adapter, `A[slot, j, :]`, against it.
The column-tile-0 program also writes the new residual, the normalised row and the zeros (every
extra column that is not one of the row's own values, all of E for a row without an adapter);
the other programs write only their values. So every element is written once, and nothing needs
clearing between launches.

The new residual goes to its own buffer, never over the old one: the other programs of the row
read the old residual while the first writes.

Per row, not per segment: a decode batch has one row per request, and a row's sums depend on that
row alone, so a graph replay on a padded bucket and an eager pass over the live rows give the same
values. At prefill sizes every row would read its adapter's A again; there shrink_pack's segments
(one A read per 16 rows) stay the better kernel.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from sglang.srt.layers.triton_ops.common import cast_rne, gdc_wait, interpreting
from sglang.srt.layers.triton_ops.rmsnorm import load_row, rms_normalize, rms_scale, row_warps
from sglang.srt.layers.triton_ops.silu_and_mul import silu_mul
from sglang.srt.lora.utils import DeferredDelta

# Elements of one A tile a program holds in registers (BLOCK_J x next_pow2(K)). At Qwen3-4B's
# qkv_proj that is 64 registers a thread at sm_90 (benchmark/kernel_resources.py), four programs an
# SM, so 64 decode rows run in two waves. Reducing one A row at a time instead (40 registers, one
# wave) was slower at every batch on an H100 (2026-12-07: +1.5 to +11 µs a launch at 1-128 rows, 4-16
# columns a program): the tile's loads, issued before the norm, hide their latency behind it.
TILE_ELEMENTS = 16384
# With `use_pdl` (the backend's: Hopper, SGLANG_LORA_PDL not 0), launched as a programmatic
# dependent of the kernel before at batches of up to this many rows: the prologue (slot, rank, A
# tile) runs while that kernel drains. bench_norm_shrink --early-start (H200, 2026-12-02, the four
# folded modules x all layers, 8 adapters; GPU µs per step against a plain launch) measured it 14-34
# µs cheaper at 1, 8, 16 and 32 rows, 25-37 µs dearer at 64 (768 programs of 8 warps waiting on SMs
# that the GEMM before still drains). The rows are a graph bucket's static count, and the launch
# mode moves no sum: graph == eager holds. A module knob, so benchmarks can time others.
PDL_MAX_ROWS = 32
# The loads that need only the row's slot go out in the round after it: the A tile's without waiting
# for the slot's rank as well (the rank's load goes out beside it), and the scaling's at the start
# rather than after the reduction (a packed module's). Unmasked by the rank, the tile reads the
# slot's rows past its compact prefix too (zeros or an earlier adapter's rows); the columns they
# feed are masked at the store by the rank, as before. The same values, bit for bit (each column's
# sum is its own). Compiled for sm_90 (Qwen3-4B qkv_proj, no PDL), the program's dependent global
# loads go from four rounds (slot -> rank and row -> A -> ... -> scaling) to two (slot and row ->
# rank, A and scaling), at 64 registers a thread as before. The expand's B_EARLY does the same for B
# (sgemm_lora_b.py). On by default since an H100 timed it (2026-12-07, the whole Qwen3-4B decode
# step with 8 adapters: norm_shrink_pack 476 -> 449 µs a step at 64 rows, 430 -> 407 at 8; alone in
# bench_norm_shrink it won up to 32 rows and lost up to 40 µs a step at 64-128). NORM_WEIGHT_EARLY
# (with EARLY_LOADS) loads the norm's weight with the row too: 74 registers, three programs an SM
# rather than four. The same H100 measured it 13 µs a step cheaper at 64 x 8, 5 dearer at 8 x 8,
# and 17-20 cheaper at 1-8 rows alone. The GPU tests then passed with it on (2026-12-07, H100,
# SGLANG_LORA_NORM_WEIGHT_EARLY=1 for the whole process), and whole steps timed it on against off
# in one process: Qwen3-4B decode 1 / 8 / 64 +11 / +7 / -9 µs of LoRA kernels a step, Llama-3.1-8B
# -4 / +2 / -21, walls within the rounds' spread both ways. Nothing to gain: it stays off.
# Module knobs, so benchmarks can time the old order against them.
EARLY_LOADS = True
NORM_WEIGHT_EARLY = os.environ.get("SGLANG_LORA_NORM_WEIGHT_EARLY", "0") == "1"


@triton.jit
def _norm_shrink_pack_kernel(
    X, R, R_OUT, NORM_W, A, XAUG, Y, ROW_SLOTS, RANKS, SCALINGS, D_S, D_BT, D_SCALINGS,
    stride_x, stride_r, stride_ro, stride_xaug, stride_y, a_stride_s, a_stride_n, stride_ds, dbt_stride_s,
    dbt_stride_r,
    K, eps,
    STACK: tl.constexpr,
    MAX_RANK: tl.constexpr,
    E_COLS: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_E: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_SILU: tl.constexpr,
    PACKED: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
    USE_PDL: tl.constexpr,
    DELTA_RANK: tl.constexpr,
    EARLY_LOADS: tl.constexpr,
    NORM_WEIGHT_EARLY: tl.constexpr,
):
    # PACKED (a folded module): XAUG is x_aug [T, K + E], Y unused. Otherwise (an unfolded one) Y
    # gets the normalised rows [T, K] and XAUG is the shrink output [T, STACK * MAX_RANK], each
    # row's compact c*r values, unscaled (the expand scales), as token_shrink writes it.
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    block_w: tl.constexpr = STACK * MAX_RANK

    # The row's adapter first, and this program's A tile loaded before the norm: it does not depend
    # on the row, so its memory latency overlaps the norm's loads and reduction (the H200 measured
    # 2.3 µs less per norm-fed module at decode 1 and 1.6 µs at 64; bench_norm_shrink.py).
    slot = tl.load(ROW_SLOTS + row)
    rank = tl.where(slot >= 0, tl.load(RANKS + tl.maximum(slot, 0)), 0)
    offs_n = tile * BLOCK_J + tl.arange(0, BLOCK_J)
    col_mask = offs_n < STACK * rank
    if EARLY_LOADS:
        # The slot's block_w rows (none for a base row); a bound, not `& (slot >= 0)` (the
        # interpreter rejects a block & a scalar).
        a_rows = offs_n < tl.where(slot >= 0, block_w, 0)
        if PACKED:
            scaling = tl.load(SCALINGS + tl.maximum(slot, 0))
        if NORM_WEIGHT_EARLY and HAS_NORM:  # a weight, not the kernel before's: also before the PDL wait
            norm_w = tl.load(NORM_W + offs, mask=mask, other=0.0)
    else:
        a_rows = col_mask
    a = tl.load(A + tl.maximum(slot, 0).to(tl.int64) * a_stride_s + offs_n[:, None] * a_stride_n + offs[None, :],
                mask=a_rows[:, None] & mask[None, :], other=0.0)
    if USE_PDL:
        # Launched as a programmatic dependent: the slot, rank and A tile above do not depend on
        # the kernel before (the GEMM or attention that wrote X / R), so their loads overlap its
        # tail; nothing it writes is read, and nothing is written, before its grid completes.
        gdc_wait()

    # ---- the module's input: the norm (_rmsnorm_kernel's own code), SiLU-and-mul of X = [gate |
    # up] (_silu_and_mul_kernel's), or the row as it is ------------------------------------------
    if HAS_SILU:
        gate = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
        up = tl.load(X + row * stride_x + K + offs, mask=mask, other=0.0)
        y = silu_mul(gate, up, XAUG.dtype.element_ty, EMULATE_RNE)
    else:
        if DELTA_RANK > 0:
            # The deferred LoRA delta of the A-folded module before (o_proj / down_proj, whose GEMM
            # wrote X = its base output and D_S = every slot's unscaled shrink): the row's module
            # output X + scaling * s[slot block] @ B[slot]^T, rounded to the model dtype as a module
            # output is, then the residual add of load_row.
            d_slot = tl.maximum(slot, 0)
            delta = tl.zeros((BLOCK,), dtype=tl.float32)
            for j in tl.static_range(DELTA_RANK):
                live = j < rank
                s_j = tl.load(D_S + row * stride_ds + d_slot * DELTA_RANK + j, mask=live, other=0.0)
                # A block-vs-scalar bound, not `mask & live` (the interpreter rejects a block & a scalar).
                b_j = tl.load(D_BT + d_slot.to(tl.int64) * dbt_stride_s + j * dbt_stride_r + offs,
                              mask=offs < tl.where(live, K, 0), other=0.0)
                delta += s_j.to(tl.float32) * b_j.to(tl.float32)
            d_scale = tl.where(rank > 0, tl.load(D_SCALINGS + d_slot), 0.0)
            x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
            x = cast_rne(x.to(tl.float32) + d_scale * delta, x.dtype, EMULATE_RNE)
            if HAS_RESIDUAL:
                res = tl.load(R + row * stride_r + offs, mask=mask, other=0.0)
                x = cast_rne(x.to(tl.float32) + res.to(tl.float32), x.dtype, EMULATE_RNE)
        else:
            x = load_row(X, R, row, stride_x, stride_r, offs, mask, HAS_RESIDUAL, EMULATE_RNE)
        if HAS_RESIDUAL and tile == 0:
            tl.store(R_OUT + row * stride_ro + offs, x, mask=mask)
        if HAS_NORM:
            if EARLY_LOADS and NORM_WEIGHT_EARLY:
                y = rms_scale(x, norm_w, K, eps, XAUG.dtype.element_ty, EMULATE_RNE)
            else:
                y = rms_normalize(x, NORM_W, offs, mask, K, eps, XAUG.dtype.element_ty, EMULATE_RNE)
        else:  # the row-wise shrink_pack alone (a module with nothing fused before it)
            y = x

    if tile == 0 and not PACKED:
        tl.store(Y + row * stride_y + offs, y, mask=mask)
    if tile == 0 and PACKED:
        tl.store(XAUG + row * stride_xaug + offs, y, mask=mask)
        for e0 in range(0, E_COLS, BLOCK_E):
            cols = e0 + tl.arange(0, BLOCK_E)
            is_value = ((cols // block_w) == slot) & (((cols % block_w) % MAX_RANK) < rank)
            tl.store(XAUG + row * stride_xaug + K + cols, tl.zeros((BLOCK_E,), dtype=XAUG.dtype.element_ty),
                     mask=(cols < E_COLS) & ~is_value)

    # ---- this tile's columns of the row's shrink: compact column n = k*r + j of A[slot] --------
    if tile * BLOCK_J < STACK * rank:
        acc = tl.sum(a.to(tl.float32) * y.to(tl.float32)[None, :], axis=1)
        if PACKED:
            if not EARLY_LOADS:
                scaling = tl.load(SCALINGS + slot)
            k_slice = offs_n // rank
            col = slot * block_w + k_slice * MAX_RANK + (offs_n - k_slice * rank)
            tl.store(XAUG + row * stride_xaug + K + col, (acc * scaling).to(XAUG.dtype.element_ty), mask=col_mask)
        else:
            tl.store(XAUG + row * stride_xaug + offs_n, acc.to(XAUG.dtype.element_ty), mask=col_mask)


def column_tile(in_dim: int) -> int:
    """BLOCK_J: how many of the stacked rank's columns one program reduces (a layer constant)."""
    return max(1, min(16, TILE_ELEMENTS // triton.next_power_of_2(in_dim)))


def _launch(x, residual, norm_weight, eps, weights, out, y, row_slots, lora_ranks, scalings, stack_num, max_rank,
            residual_out, packed: bool, silu: bool = False, use_pdl: bool = False,
            delta: Optional[DeferredDelta] = None) -> Optional[torch.Tensor]:
    rows = x.shape[0]
    in_dim = x.shape[1] // 2 if silu else x.shape[1]  # SiLU-and-mul: x = [gate | up]
    assert not silu or (norm_weight is None and residual is None and x.shape[1] == 2 * in_dim)
    if norm_weight is not None and norm_weight.shape != (in_dim,):
        raise ValueError(f"norm weight shape {tuple(norm_weight.shape)} does not match rows of {in_dim}")
    assert norm_weight is not None or residual is None, "a residual comes with a norm"
    assert weights.shape[1:] == (stack_num * max_rank, in_dim) and weights.stride(2) == 1, weights.shape
    assert out.shape[0] == rows and out.stride(1) == 1 and x.stride(1) == 1 and row_slots.shape == (rows,)
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1
        if residual_out is None:
            residual_out = torch.empty_like(residual)
        assert residual_out.data_ptr() != residual.data_ptr(), "the new residual needs its own buffer"
    if rows == 0:
        return residual_out
    block = triton.next_power_of_2(in_dim)
    block_j = column_tile(in_dim)
    extra = out.shape[1] - in_dim if packed else 0
    r = residual if residual is not None else x
    ro = residual_out if residual is not None else x
    y = y if y is not None else out
    pdl = use_pdl and rows <= PDL_MAX_ROWS
    if delta is not None:
        assert norm_weight is not None and not silu, "a deferred delta is added before a norm"
        assert delta.shrink.shape[0] == rows and delta.shrink.stride(1) == 1, delta.shrink.shape
        assert delta.bt.shape[2] == in_dim and delta.bt.stride(2) == 1 and delta.bt.shape[1] == delta.max_rank
        d_s, d_bt, d_scalings = delta.shrink, delta.bt, delta.scalings
        d_strides = (delta.shrink.stride(0), delta.bt.stride(0), delta.bt.stride(1))
    else:
        d_s, d_bt, d_scalings, d_strides = x, x, scalings, (0, 0, 0)
    _norm_shrink_pack_kernel[(rows, triton.cdiv(stack_num * max_rank, block_j))](
        x, r, ro, norm_weight if norm_weight is not None else x, weights, out, y, row_slots, lora_ranks, scalings,
        d_s, d_bt, d_scalings,
        x.stride(0), r.stride(0), ro.stride(0), out.stride(0), y.stride(0), weights.stride(0), weights.stride(1),
        *d_strides,
        in_dim, eps,
        STACK=stack_num, MAX_RANK=max_rank, E_COLS=extra, BLOCK=block, BLOCK_J=block_j,
        BLOCK_E=min(1024, triton.next_power_of_2(max(extra, 16))),
        HAS_NORM=norm_weight is not None, HAS_RESIDUAL=residual is not None, HAS_SILU=silu, PACKED=packed,
        EMULATE_RNE=interpreting(), USE_PDL=pdl, DELTA_RANK=delta.max_rank if delta is not None else 0,
        EARLY_LOADS=EARLY_LOADS, NORM_WEIGHT_EARLY=NORM_WEIGHT_EARLY,
        # rmsnorm_fwd's warps for the row: the same reduction tree, so the norm equals its output.
        num_warps=row_warps(in_dim),
        **({"launch_pdl": True} if pdl else {}),
    )
    return residual_out


def norm_shrink_pack(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    norm_weight: Optional[torch.Tensor],
    eps: float,
    weights: torch.Tensor,
    x_aug: torch.Tensor,
    row_slots: torch.Tensor,
    lora_ranks: torch.Tensor,
    scalings: torch.Tensor,
    stack_num: int,
    max_rank: int,
    residual_out: Optional[torch.Tensor] = None,
    use_pdl: bool = False,
    delta: Optional[DeferredDelta] = None,
) -> Optional[torch.Tensor]:
    """x_aug [T, K + E] = [RMSNorm(x (+ residual)) | its packed pre-scaled shrink] in one launch.

    `weights` is the module's A [S, stack*max_rank, K] (an adapter of rank r in its first
    stack*r rows; every slot but the last, the base model's of rank 0, has a block in E),
    `row_slots` int32 [T] each row's slot (-1: none). With `residual`, the sum x + residual (the
    new residual) goes to `residual_out` (allocated when None; never `residual` itself) and is
    returned; without, returns None. `norm_weight` None: no norm (and no
    residual), x_aug = [x | packed shrink of x], shrink_pack's result computed row by row.
    `use_pdl` (the backend's decision; every function here takes it): a programmatic dependent
    launch at batches of up to PDL_MAX_ROWS rows. `delta`: x is an A-folded module's base output,
    and its row's LoRA delta is added (and rounded, as the module's output) before the residual.
    """
    assert x_aug.shape[1] - x.shape[1] >= (weights.shape[0] - 1) * stack_num * max_rank, x_aug.shape
    return _launch(x, residual, norm_weight, eps, weights, x_aug, None, row_slots, lora_ranks, scalings, stack_num,
                   max_rank, residual_out, packed=True, use_pdl=use_pdl, delta=delta)


def silu_shrink_pack(gate_up: torch.Tensor, weights: torch.Tensor, x_aug: torch.Tensor, row_slots: torch.Tensor,
                     lora_ranks: torch.Tensor, scalings: torch.Tensor, max_rank: int, use_pdl: bool = False) -> None:
    """x_aug [T, d + E] = [silu(gate) * up | its packed pre-scaled shrink] from gate_up [T, 2d]:
    the SiLU-and-mul before a folded down_proj and its shrink_pack in one launch."""
    d = gate_up.shape[1] // 2
    assert x_aug.shape[1] - d >= (weights.shape[0] - 1) * max_rank, x_aug.shape
    _launch(gate_up, None, None, 0.0, weights, x_aug, None, row_slots, lora_ranks, scalings, 1, max_rank, None,
            packed=True, silu=True, use_pdl=use_pdl)


def silu_shrink(gate_up: torch.Tensor, weights: torch.Tensor, act_out: torch.Tensor, xa: torch.Tensor,
                row_slots: torch.Tensor, lora_ranks: torch.Tensor, max_rank: int, use_pdl: bool = False) -> None:
    """act_out [T, d] = silu(gate) * up and xa its compact unscaled shrink (an unfolded down_proj)."""
    assert act_out.shape == (gate_up.shape[0], gate_up.shape[1] // 2) and act_out.stride(1) == 1
    _launch(gate_up, None, None, 0.0, weights, xa, act_out, row_slots, lora_ranks, lora_ranks, 1, max_rank, None,
            packed=False, silu=True, use_pdl=use_pdl)


def norm_shrink(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    norm_weight: torch.Tensor,
    eps: float,
    weights: torch.Tensor,
    normed_out: torch.Tensor,
    xa: torch.Tensor,
    row_slots: torch.Tensor,
    lora_ranks: torch.Tensor,
    stack_num: int,
    max_rank: int,
    residual_out: Optional[torch.Tensor] = None,
    use_pdl: bool = False,
    delta: Optional[DeferredDelta] = None,
) -> Optional[torch.Tensor]:
    """For an unfolded module: normed_out [T, K] = RMSNorm(x (+ residual)) and xa [T, stack*max_rank]
    its shrink, xa[t, :c*r] = normed[t] @ A[slot(t), :c*r]^T (unscaled; what token_shrink writes, and
    the expand kernels read). Rows without an adapter get nothing in xa. Returns, and takes `delta`,
    as norm_shrink_pack."""
    assert normed_out.shape == x.shape and normed_out.stride(1) == 1
    assert xa.shape[1] >= stack_num * max_rank, xa.shape
    # No scalings here (the expand applies them): the kernel's scalings argument goes unread.
    return _launch(x, residual, norm_weight, eps, weights, xa, normed_out, row_slots, lora_ranks, lora_ranks,
                   stack_num, max_rank, residual_out, packed=False, use_pdl=use_pdl, delta=delta)


__all__ = ["DeferredDelta", "norm_shrink_pack", "norm_shrink", "silu_shrink_pack", "silu_shrink", "column_tile"]
