"""RMSNorm with the residual add fused in, one program per row.

Rounding follows the Hugging Face reference (and `RMSNorm.forward_torch`): the sum `x + residual`
is rounded to the model dtype (it is the new residual), the statistics are taken in float32, the
normalised row is rounded to the model dtype *before* the weight multiplies it, and the product is
rounded once more. In float32 every rounding is a no-op.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sglang.srt.layers.triton_ops.common import cast_rne, interpreting, release_dependents, release_enabled


@triton.jit
def load_row(X, R, row, stride_x, stride_r, offs, mask, HAS_RESIDUAL: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """Row `row` of X, plus the same row of R (rounded to the model dtype: the new residual)."""
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0)
        x = cast_rne(x.to(tl.float32) + r.to(tl.float32), x.dtype, EMULATE_RNE)
    return x


@triton.jit
def rms_normalize(x, W, offs, mask, n_cols, eps, OUT_DTYPE: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """The normalised row (a row `x` in the model dtype, already summed with its residual) times
    the weight, in OUT_DTYPE, with the roundings above. Shared by every kernel that normalises a
    row (lora/triton_ops/norm_shrink_pack.py), so they all give the same bits."""
    # The weight's load after the reduction, in program order: moving it before (rms_scale) changes
    # the compiled kernels' registers (norm_shrink_pack's qkv_proj tile: 64 -> 73 at sm_90).
    normed = _rms_normed(x, n_cols, eps, EMULATE_RNE)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    return cast_rne(normed * w, OUT_DTYPE, EMULATE_RNE)


@triton.jit
def rms_scale(x, w, n_cols, eps, OUT_DTYPE: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """rms_normalize with the weight's row `w` already loaded: a kernel that loads it with its input
    has it in hand when the reduction ends, one round trip to memory fewer per program."""
    normed = _rms_normed(x, n_cols, eps, EMULATE_RNE)
    return cast_rne(normed * w.to(tl.float32), OUT_DTYPE, EMULATE_RNE)


@triton.jit
def _rms_normed(x, n_cols, eps, EMULATE_RNE: tl.constexpr):
    """The row times its reciprocal RMS, rounded to the row's dtype, in float32."""
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    return cast_rne(xf * rstd, x.dtype, EMULATE_RNE).to(tl.float32)


# Whether the kernel releases its programmatic dependents at its start (with RELEASE_DEPENDENTS, see
# common.py): only a LoRA shrink_pack at prefill is one. Off until the GPU measures it
# (profile_forward's `lora-norm-release` variant against `lora`).
RELEASE_AT_START = False
# Whether the kernel loads the weight's row with the input's, before the row's reduction, rather
# than after it: one dependent round trip to memory fewer per program, the same bits. On since the
# H100 timed it (2026-12-07, bench_norm_shrink: 10-20 µs a step fewer over the Qwen3-4B and
# Llama-3.1-8B norms; profile_forward's `none-late-loads` variant turns it off).
WEIGHT_FIRST = True


@triton.jit
def _rmsnorm_kernel(
    X, R, W, Y,
    stride_x, stride_r, stride_y,
    n_cols, eps,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
    RELEASE: tl.constexpr,
    WEIGHT_FIRST: tl.constexpr,
):
    # A LoRA shrink_pack launched as a programmatic dependent (a folded qkv_proj's or
    # gate_up_proj's where no kernel fuses the norm: prefill) reads its segments meanwhile; it
    # waits for this grid before it reads the rows.
    release_dependents(RELEASE)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    if WEIGHT_FIRST:
        w = tl.load(W + offs, mask=mask, other=0.0)
    x = load_row(X, R, row, stride_x, stride_r, offs, mask, HAS_RESIDUAL, EMULATE_RNE)
    if HAS_RESIDUAL:
        tl.store(R + row * stride_r + offs, x, mask=mask)
    if WEIGHT_FIRST:
        y = rms_scale(x, w, n_cols, eps, Y.dtype.element_ty, EMULATE_RNE)
    else:
        y = rms_normalize(x, W, offs, mask, n_cols, eps, Y.dtype.element_ty, EMULATE_RNE)
    tl.store(Y + row * stride_y + offs, y, mask=mask)


def row_warps(n_cols: int) -> int:
    """The warps of a program that normalises one row of `n_cols`: a launch constant of the layer,
    never of the batch, so graph buckets and eager passes of any token count run the same
    reduction. Every kernel that gives rmsnorm_fwd's bits (lora/triton_ops/norm_shrink_pack.py)
    launches with these warps: the same reduction tree."""
    block = triton.next_power_of_2(n_cols)
    return 8 if block >= 4096 else (4 if block >= 1024 else 2)


def _rows(t: torch.Tensor, n_cols: int, written: bool) -> torch.Tensor:
    # A tensor the kernel writes must be a view (a reshaped copy would swallow the result).
    t2 = t.view(-1, n_cols) if written else t.reshape(-1, n_cols)
    if t2.stride(-1) != 1:
        raise ValueError("RMSNorm rows must be contiguous")
    return t2


def rmsnorm_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Normalise the rows of `x` ([..., N]) into `out` (a new tensor when None; may be `x`).

    With `residual`, `residual` becomes `x + residual` in place first and the sum is normalised.
    Returns `out`.
    """
    n_cols = x.shape[-1]
    if weight.shape != (n_cols,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match rows of {n_cols}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    x2 = _rows(x, n_cols, written=out is x)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y2 = _rows(out, n_cols, written=True)
    r2 = _rows(residual, n_cols, written=True) if residual is not None else x2
    n_rows = x2.shape[0]
    if n_rows == 0:
        return out
    block = triton.next_power_of_2(n_cols)
    num_warps = row_warps(n_cols)
    _rmsnorm_kernel[(n_rows,)](
        x2, r2, weight, y2,
        x2.stride(0), r2.stride(0), y2.stride(0),
        n_cols, eps,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        EMULATE_RNE=interpreting(),
        RELEASE=RELEASE_AT_START and release_enabled(x.device),
        WEIGHT_FIRST=WEIGHT_FIRST,
        num_warps=num_warps,
    )
    return out


__all__ = ["rmsnorm_fwd"]
