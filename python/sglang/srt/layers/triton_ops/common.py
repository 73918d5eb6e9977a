"""Helpers shared by the fused kernels."""

from __future__ import annotations

import os

import triton
import triton.language as tl


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (kernels run on the CPU through numpy)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def cast_rne(x, DTYPE: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """float32 `x` rounded to DTYPE to nearest, ties to even (what torch does on every device).

    The GPU's conversion already rounds so; the interpreter truncates float32 -> bfloat16 casts,
    so under it (EMULATE_RNE) the rounding is done on the bits first, leaving an exact cast.
    """
    if EMULATE_RNE and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE)
