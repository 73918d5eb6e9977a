"""Helpers shared by the fused kernels."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:  # Hopper grid dependency control (programmatic dependent launch); None where triton lacks it
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - triton without the intrinsics
    gdc_launch_dependents = gdc_wait = None


def dot_precision(*tensors: torch.Tensor) -> str:
    """tl.dot's input precision: fp32 inputs must not silently drop to tf32 (the torch reference and
    cuBLAS's default are exact fp32); other dtypes take their own."""
    return "ieee" if any(t.dtype == torch.float32 for t in tensors) else "tf32"


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (kernels run on the CPU through numpy)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def pdl_available(device: torch.device) -> bool:
    """Programmatic dependent launch: NVIDIA Hopper or newer, a triton with the intrinsics, no
    interpreter. (ROCm also reports device type "cuda", with other capability numbers.)"""
    if device.type != "cuda" or torch.version.hip is not None or gdc_launch_dependents is None or interpreting():
        return False
    return _major_capability(device.index if device.index is not None else torch.cuda.current_device()) >= 9


@functools.lru_cache(maxsize=None)
def _major_capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


# Whether the kernels that precede a LoRA shrink (SiLU-and-mul, decode attention's merge; RMSNorm
# with its RELEASE_AT_START) release their programmatic dependents at their start. A module knob so
# that a benchmark can time both.
RELEASE_DEPENDENTS = True


def release_enabled(device: torch.device) -> bool:
    """The RELEASE constexpr of a kernel that calls `release_dependents`."""
    return RELEASE_DEPENDENTS and pdl_available(device)


@triton.jit
def release_dependents(ENABLED: tl.constexpr):
    """Let a kernel launched after this one as a programmatic dependent start now (its blocks run
    their prologue, then wait for this grid's completion before they read what it writes). A no-op
    for a successor launched normally, so the base model's kernels are unaffected."""
    if ENABLED:
        gdc_launch_dependents()


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
