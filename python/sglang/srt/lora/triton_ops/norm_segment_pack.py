"""RMSNorm and a folded module's shrink_pack in ONE launch, by segments (prefill and large decode).

Where no kernel fuses the norm with the shrink (prefill; norm_shrink_pack.py is row by row, for
decode), a folded qkv_proj / gate_up_proj costs two dependent launches before its GEMM: the norm,
written into x_aug's first columns (SGLANG_LORA_PACK_IN_PLACE), then shrink_pack over it. At short
prefills both are latency-bound (a few µs each for a few hundred KB), so the second launch and the
idle GPU between them are most of what LoRA adds there. This kernel runs both in one grid, with no
program waiting for another:

  row programs      (the last `num_rows` of the grid) `_rmsnorm_kernel`'s own code for one row:
                    x (+ residual) -> the new residual (its own buffer) and the normalised row
                    into x_aug[:, :K], bit for bit what rmsnorm_fwd writes (same helpers, same
                    warps);
  segment programs  (the first `seg_programs`) shrink_pack's grid and plan (segments x column
                    tiles x K splits, zero stripes, split-K tickets), but reading the norm's INPUT:
                    the normalisation is one scale per row, so

                        shrink(row) = rstd(row) * ((x (+ residual)) * w) @ A^T,

                    where the K-split programs also sum x^2 and the finishing program of the
                    segment's tile applies rstd = rsqrt(sum / K + eps) and the scaling. None of
                    them reads what the row programs write.

The shrink is rounded differently from shrink_pack's over the normalised rows (it multiplies the
bf16 product x * w by rstd in float32 at the end instead of rounding x * rstd first): the same
function within bf16 rounding. Each row's sums depend on the static plan only (a row's dot and its
sum of squares are per row; split partials meet in a fixed order), so a graph replay on a padded
bucket and an eager pass compute every row bit for bit alike.

The new residual goes to its own buffer: the segment programs read the old one while the row
programs write.

Measured (H100, 2026-12-06, benchmark/lora/probe_norm_segment_pack.py): the row programs cost
nothing beside the segment programs, but those take longer than shrink_pack's (Qwen3-4B qkv_proj
at 128 rows 9.8 against 6.2 µs: three reads and a sum of squares per tile, at rmsnorm's 8 warps),
so the launch saved is spent again. Off by default (backend/token_backend.py,
SGLANG_LORA_NORM_SEGMENTS).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from sglang.srt.layers.triton_ops.common import cast_rne, interpreting
from sglang.srt.layers.triton_ops.rmsnorm import load_row, rms_normalize, row_warps
from sglang.srt.lora.triton_ops._tiles import dot_precision
from sglang.srt.lora.triton_ops._token_rows import segment_rows
from sglang.srt.lora.triton_ops.launch import BoundKernel, PreparedLaunch
from sglang.srt.lora.triton_ops.token_lora import PackPlan, pack_block_e, plan_pack, token_segments


@triton.jit
def _norm_segment_pack_kernel(
    x_ptr,
    r_ptr,
    r_out_ptr,
    norm_w_ptr,
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
    r_stride_t,
    ro_stride_t,
    w_stride_s,
    w_stride_n,
    xaug_stride_t,
    n_tiles,
    seg_programs,
    EPS: tl.constexpr,
    STACK: tl.constexpr,
    MAX_RANK: tl.constexpr,
    E_COLS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid >= seg_programs:
        # ---- a row program: _rmsnorm_kernel's body, the new residual to its own buffer ----------
        row = (pid - seg_programs).to(tl.int64)
        offs = tl.arange(0, ROW_BLOCK)
        mask = offs < K
        xr = load_row(x_ptr, r_ptr, row, x_stride_t, r_stride_t, offs, mask, HAS_RESIDUAL, EMULATE_RNE)
        if HAS_RESIDUAL:
            tl.store(r_out_ptr + row * ro_stride_t + offs, xr, mask=mask)
        y = rms_normalize(xr, norm_w_ptr, offs, mask, K, EPS, xaug_ptr.dtype.element_ty, EMULATE_RNE)
        tl.store(xaug_ptr + row * xaug_stride_t + offs, y, mask=mask)
        return

    # ---- a segment program: shrink_pack's, over the norm's input --------------------------------
    split = pid % SPLIT
    tile = pid // SPLIT
    tile_n = tile % n_tiles
    seg = tile // n_tiles
    rows, row_mask, active_rows, slot, rank = segment_rows(perm_ptr, seg_indptr_ptr, weight_indices_ptr,
                                                           lora_ranks_ptr, seg, num_rows, BLOCK_S)
    if tl.load(seg_indptr_ptr + seg) >= tl.load(seg_indptr_ptr + seg + 1):
        return  # an empty segment (past the live batch's): nothing to write

    # Zeros: every extra column that is not one of the rows' own values, in stripes dealt out
    # over the segment's programs (shrink_pack's layout).
    block_w: tl.constexpr = STACK * MAX_RANK
    programs = n_tiles * SPLIT
    for e0 in range((tile_n * SPLIT + split) * BLOCK_E, E_COLS, programs * BLOCK_E):
        cols = e0 + tl.arange(0, BLOCK_E)
        is_value = ((cols // block_w) == slot) & (((cols % block_w) % MAX_RANK) < rank)
        mask = row_mask[:, None] & ((cols < E_COLS) & ~is_value)[None, :]
        ptrs = xaug_ptr + rows[:, None] * xaug_stride_t + K + cols[None, :]
        tl.store(ptrs, tl.zeros((BLOCK_S, BLOCK_E), dtype=xaug_ptr.dtype.element_ty), mask=mask)
    if rank <= 0:
        return  # no adapter: the zeros are all
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = offs_n < STACK * rank
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)

    acc = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
    sumsq = tl.zeros((BLOCK_S,), dtype=tl.float32)
    x_ptrs = x_ptr + rows[:, None] * x_stride_t + (k_lo + offs_k)[None, :]
    r_ptrs = r_ptr + rows[:, None] * r_stride_t + (k_lo + offs_k)[None, :]
    nw_ptrs = norm_w_ptr + k_lo + offs_k
    w_ptrs = (w_ptr + slot.to(tl.int64) * w_stride_s + offs_n[None, :] * w_stride_n + (k_lo + offs_k)[:, None])
    for k in range(k_lo, k_hi, BLOCK_K):
        k_mask = offs_k < k_hi - k
        tile_mask = row_mask[:, None] & k_mask[None, :]
        xt = tl.load(x_ptrs, mask=tile_mask, other=0.0)
        if HAS_RESIDUAL:
            rt = tl.load(r_ptrs, mask=tile_mask, other=0.0)
            xt = cast_rne(xt.to(tl.float32) + rt.to(tl.float32), xt.dtype, EMULATE_RNE)  # the new residual
        xf = xt.to(tl.float32)
        sumsq += tl.sum(xf * xf, axis=1)
        nw = tl.load(nw_ptrs, mask=k_mask, other=0.0).to(tl.float32)
        xw = cast_rne(xf * nw[None, :], xt.dtype, EMULATE_RNE)
        a = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(xw, a.to(xw.dtype), acc, input_precision=DOT_PREC)
        x_ptrs += BLOCK_K
        r_ptrs += BLOCK_K
        nw_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    value_mask = active_rows[:, None] & col_mask[None, :]
    if SPLIT > 1:
        # shrink_pack's ticket reduction (_token_rows.split_k_finish) with the sums of squares
        # beside the partials: [SPLIT, rows, n_tiles * BLOCK_N] then [SPLIT, rows, n_tiles].
        part_ptrs = part_ptr + (rows[:, None] * (n_tiles * BLOCK_N) + offs_n[None, :])
        ss_ptrs = part_ptr + SPLIT * part_plane + rows * n_tiles + tile_n
        ss_plane = num_rows * n_tiles
        tl.store(part_ptrs + split * part_plane, acc, mask=value_mask)
        tl.store(ss_ptrs + split * ss_plane, sumsq, mask=active_rows)
        tl.debug_barrier()  # every thread's partials written before the ticket (release, GPU scope)
        ticket = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if ticket != SPLIT - 1:
            return
        tl.atomic_xchg(counter_ptr + tile, 0, sem="relaxed", scope="gpu")  # re-armed for the next launch
        acc = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
        sumsq = tl.zeros((BLOCK_S,), dtype=tl.float32)
        for p in range(SPLIT):  # a fixed order: deterministic
            acc += tl.load(part_ptrs + p * part_plane, mask=value_mask, other=0.0, cache_modifier=".cg")
            sumsq += tl.load(ss_ptrs + p * ss_plane, mask=active_rows, other=0.0, cache_modifier=".cg")
    rstd = tl.math.rsqrt(sumsq / K + EPS)
    scaling = tl.load(scalings_ptr + slot)
    # Compact column n = k*r + j of the shrink goes to slice k's column k*R + j of the block.
    k_slice = offs_n // rank
    col = slot * block_w + k_slice * MAX_RANK + (offs_n - k_slice * rank)
    ptrs = xaug_ptr + rows[:, None] * xaug_stride_t + K + col[None, :]
    tl.store(ptrs, (acc * (rstd * scaling)[:, None]).to(xaug_ptr.dtype.element_ty), mask=value_mask)


def workspace_numel(plan: PackPlan, num_rows: int) -> int:
    """fp32 elements of the split-K partials and sums of squares of `num_rows` rows (0 unsplit)."""
    s = plan.shrink
    return s.split * num_rows * s.n_tiles * (s.block_n + 1) if s.split > 1 else 0


@functools.lru_cache(maxsize=None)
def _bound(plan: PackPlan, eps: float, has_residual: bool, dot_prec: str) -> BoundKernel:
    s = plan.shrink
    return BoundKernel(
        _norm_segment_pack_kernel,
        dict(EPS=eps, STACK=plan.stack, MAX_RANK=plan.max_rank, E_COLS=plan.extra_cols, BLOCK_S=s.block_s,
             BLOCK_N=s.block_n, BLOCK_K=s.block_k, BLOCK_E=pack_block_e(plan), SPLIT=s.split, DOT_PREC=dot_prec,
             HAS_RESIDUAL=has_residual, ROW_BLOCK=triton.next_power_of_2(s.in_dim), EMULATE_RNE=interpreting()),
        # rmsnorm_fwd's warps (the row programs' bits). One stage: a program's K loop runs once at
        # the plans' split (K_PER_SPLIT deep), so a pipeline only multiplies shared memory (66 KB a
        # program at 3 stages against 16 KB, sm_90 compile), and with it fewer programs fit an SM.
        num_warps=row_warps(s.in_dim), num_stages=1,
    )


def prepare_norm_pack(plan: PackPlan, num_rows: int, num_segments: int, eps: float, has_residual: bool,
                      x: torch.Tensor, weights: torch.Tensor, xaug_stride: int) -> PreparedLaunch:
    """One launch shape for a batch (x, weights: examples with the layers' strides and dtypes; the
    residual and its new buffer are dense rows of x's width)."""
    s = plan.shrink
    assert x.stride(1) == 1 and weights.stride(2) == 1, "K must be the contiguous dimension"
    assert weights.numel() < 2**31 and num_rows * xaug_stride < 2**31, "offsets are 32-bit in the kernel"
    seg_programs = plan.grid(num_segments)[0]
    bound = _bound(plan, float(eps), has_residual, dot_precision(x, weights))
    ints = s.ints(num_rows) + (x.stride(0), s.in_dim, s.in_dim, weights.stride(0), weights.stride(1), xaug_stride,
                               s.n_tiles, seg_programs)
    return bound.prepare((seg_programs + num_rows,), ints)


def launch_norm_pack(launch: PreparedLaunch, x: torch.Tensor, residual: Optional[torch.Tensor],
                     residual_out: Optional[torch.Tensor], norm_weight: torch.Tensor, weights: torch.Tensor,
                     x_aug: torch.Tensor, workspace: torch.Tensor, counters: torch.Tensor, perm: torch.Tensor,
                     seg_indptr: torch.Tensor, weight_indices: torch.Tensor, lora_ranks: torch.Tensor,
                     scalings: torch.Tensor) -> None:
    """Run a prepared launch: x_aug = [RMSNorm(x (+ residual)) | packed pre-scaled shrink], the new
    residual into `residual_out` (never `residual` itself)."""
    if residual is not None:
        assert residual_out is not None and residual_out.data_ptr() != residual.data_ptr(), "own buffer"
        assert residual.stride(0) == x.shape[1] and residual_out.stride(0) == x.shape[1]
    r = residual if residual is not None else x
    ro = residual_out if residual_out is not None else x
    launch(x, r, ro, norm_weight, weights, x_aug, workspace, counters, perm, seg_indptr, weight_indices, lora_ranks,
           scalings)


def norm_segment_pack(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    norm_weight: torch.Tensor,
    eps: float,
    weights: torch.Tensor,
    x_aug: torch.Tensor,
    token_slots: torch.Tensor,
    lora_ranks: torch.Tensor,
    scalings: torch.Tensor,
    stack: int,
    max_rank: int,
    block_s: int = 16,
    residual_out: Optional[torch.Tensor] = None,
) -> Optional[torch.Tensor]:
    """One-call entry point (tests, benchmarks): rows' slots `token_slots` (int32 [T], -1 none),
    each row its own segment run (token_lora.token_segments). Returns the new residual (allocated
    when `residual_out` is None) or None without a residual."""
    rows, in_dim = x.shape
    plan = plan_pack(in_dim, stack, max_rank, x_aug.shape[1] - in_dim, x.element_size(), block_s)
    perm, seg_indptr, weight_indices, n = token_segments(token_slots, lora_ranks, block_s)
    if residual is not None and residual_out is None:
        residual_out = torch.empty_like(residual)
    workspace = torch.empty(max(1, workspace_numel(plan, rows)), dtype=torch.float32, device=x.device)
    counters = torch.zeros(max(1, plan.shrink.num_counters(n)), dtype=torch.int32, device=x.device)
    launch = prepare_norm_pack(plan, rows, n, eps, residual is not None, x, weights, x_aug.stride(0))
    launch_norm_pack(launch, x, residual, residual_out, norm_weight, weights, x_aug, workspace, counters, perm,
                     seg_indptr, weight_indices, lora_ranks, scalings)
    return residual_out


__all__ = ["norm_segment_pack", "prepare_norm_pack", "launch_norm_pack", "workspace_numel"]
