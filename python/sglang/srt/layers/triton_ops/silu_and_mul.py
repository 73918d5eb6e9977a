"""SiLU-and-mul of the gated MLP in one kernel: [gate | up] -> silu(gate) * up.

Rounding follows the torch reference `F.silu(gate) * up`: silu is computed in float32 and rounded
to the model dtype, then the product is computed in float32 and rounded again.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sglang.srt.layers.triton_ops.common import cast_rne, interpreting, release_dependents, release_enabled

_BLOCK = 1024


@triton.jit
def silu_mul(gate, up, OUT_DTYPE: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """silu(gate) * up with the roundings above; shared by every kernel that computes it
    (lora/triton_ops/norm_shrink_pack.py), so they all give the same bits."""
    g = gate.to(tl.float32)
    act = cast_rne(g / (1.0 + tl.exp(-g)), gate.dtype, EMULATE_RNE).to(tl.float32)
    return cast_rne(act * up.to(tl.float32), OUT_DTYPE, EMULATE_RNE)


@triton.jit
def _silu_and_mul_kernel(X, Y, stride_x, stride_y, d, BLOCK: tl.constexpr, EMULATE_RNE: tl.constexpr,
                         RELEASE: tl.constexpr):
    # A LoRA shrink launched as a programmatic dependent (down_proj's) reads its adapter's weights
    # while this runs; it waits for this grid before it reads the output.
    release_dependents(RELEASE)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(X + row * stride_x + d + cols, mask=mask, other=0.0)
    tl.store(Y + row * stride_y + cols, silu_mul(gate, up, Y.dtype.element_ty, EMULATE_RNE), mask=mask)


def silu_and_mul_fwd(x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., 2d] -> [..., d], into `out` when given: [rows, d] with contiguous rows and any row
    stride (e.g. the first d columns of a LoRA module's x_aug, lora/norm_fusion.py)."""
    if x.shape[-1] % 2:
        raise ValueError(f"the last dim ({x.shape[-1]}) must be even: [gate | up]")
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    assert x2.stride(-1) == 1, "rows must be contiguous"
    if out is None:
        out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
        y2 = out.view(-1, d)
    else:
        assert out.shape == (x2.shape[0], d) and out.stride(1) == 1 and out.dtype == x.dtype, (out.shape, x.shape)
        y2 = out
    n_rows = x2.shape[0]
    if n_rows == 0 or d == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(n_rows, triton.cdiv(d, block))](
        x2, y2, x2.stride(0), y2.stride(0), d, BLOCK=block, EMULATE_RNE=interpreting(),
        RELEASE=release_enabled(x.device), num_warps=4
    )
    return out


__all__ = ["silu_and_mul_fwd"]
