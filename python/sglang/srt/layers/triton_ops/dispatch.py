"""Which implementation a fused layer runs: the Triton kernel or its torch reference.

`SGLANG_FUSED_KERNELS` (read once, at the first call):
  auto    (default) Triton on CUDA tensors, the torch reference on every other device. The CPU
          server suite runs the references: interpreted Triton in every layer would be far too slow.
  triton  Triton everywhere; on CPU tensors this needs TRITON_INTERPRET=1 (tests use it to run a
          whole tiny model through the kernels and compare with the torch path).
  torch   the references everywhere (e.g. to bisect a numerical difference on the GPU).

Eager forwards and captured graphs call the same function, so both paths run the same kernels.
Code that torch.compile traces (the tc_piecewise prefill graph) takes the torch references, which
inductor fuses into kernels of its own.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

import torch

ENV_VAR = "SGLANG_FUSED_KERNELS"
MODES = ("auto", "triton", "torch")

_mode: Optional[str] = None


def _read_mode() -> str:
    mode = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{ENV_VAR} must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def fused_kernels_mode() -> str:
    global _mode
    if _mode is None:
        _mode = _read_mode()
    return _mode


def use_triton(x: torch.Tensor) -> bool:
    """True when the fused layers should run their Triton kernel on `x`'s device."""
    if torch.compiler.is_compiling():
        return False
    mode = _mode if _mode is not None else fused_kernels_mode()
    if mode == "auto":
        return x.is_cuda
    if mode == "torch":
        return False
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{ENV_VAR}=triton on {x.device} tensors needs TRITON_INTERPRET=1")
    return True


@contextlib.contextmanager
def fused_kernels(mode: str) -> Iterator[None]:
    """Run a block under another mode (tests compare the Triton and torch paths in one process)."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    previous = fused_kernels_mode()
    _mode = mode
    try:
        yield
    finally:
        _mode = previous
