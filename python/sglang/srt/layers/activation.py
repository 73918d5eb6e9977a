"""Activations of the gated MLP."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.layers.triton_ops.dispatch import use_triton
from sglang.srt.layers.triton_ops.silu_and_mul import silu_and_mul_fwd


class SiluAndMul(nn.Module):
    """x = [gate | up] along the last dim -> silu(gate) * up (one kernel on the Triton path)."""

    def __init__(self) -> None:
        super().__init__()
        # The seam RMSNorm has too (layers/layernorm.py): the layer this activation feeds may run
        # it inside its own first kernel; returns the activation, or None to let it run as written.
        self.fusion: Optional[Callable[[torch.Tensor], Optional[torch.Tensor]]] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fusion is not None:
            fused = self.fusion(x)
            if fused is not None:
                return fused
        if use_triton(x):
            return silu_and_mul_fwd(x)
        return self.forward_torch(x)

    @staticmethod
    def forward_torch(x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
