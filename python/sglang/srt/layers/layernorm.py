"""RMSNorm, with the residual add fused into the same call (pre-norm transformer blocks)."""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
from torch import nn

from sglang.srt.layers.triton_ops.dispatch import use_triton
from sglang.srt.layers.triton_ops.rmsnorm import rmsnorm_fwd


NormResult = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        # A seam for the layer this norm feeds, to run the norm inside its own first kernel (LoRA's
        # folded modules at decode: lora/norm_fusion.py sets it; models never do). Called with
        # (x, residual); returns what forward would, or None to let the norm run as written.
        self.fusion: Optional[Callable[[torch.Tensor, Optional[torch.Tensor]], Optional[NormResult]]] = None

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Normalise `x`; with `residual`, first add it and also return the sum (the new residual).

        The Triton path (one kernel) works in place when given a residual: the sum goes into
        `residual` and the normalised rows into `x`, which are returned. Callers treat both inputs
        as consumed, whichever path runs.
        """
        if self.fusion is not None:
            fused = self.fusion(x, residual)
            if fused is not None:
                return fused
        if use_triton(x):
            if residual is None:
                return rmsnorm_fwd(x, self.weight, self.variance_epsilon)
            rmsnorm_fwd(x, self.weight, self.variance_epsilon, residual=residual, out=x)
            return x, residual
        return self.forward_torch(x, residual)

    def forward_torch(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The reference (CPU path, test oracle). The statistics are taken in float32 and the
        result is cast back before the weight is applied, the same rounding order as the Hugging
        Face reference, so bf16 runs track it."""
        if residual is not None:
            x = x + residual
            residual = x
        orig_dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        out = self.weight * xf.to(orig_dtype)
        return out if residual is None else (out, residual)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.variance_epsilon}"
