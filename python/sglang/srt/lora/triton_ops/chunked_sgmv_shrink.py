"""Chunked-SGMV shrink (`csgmv` backend).

Segments are fixed-size chunks of adapter-sorted positions; `batch_info.permutation` maps each
sorted position to its token row, so tokens of one adapter share weight tiles even when they come
from different requests. Results land in token order (row permutation[p]).
"""

from __future__ import annotations

import torch

from sglang.srt.lora.triton_ops.sgemm_lora_a import segmented_shrink
from sglang.srt.lora.utils import LoRABatchInfo


def chunked_sgmv_lora_shrink_forward(
    x: torch.Tensor,
    weights: torch.Tensor,
    batch_info: LoRABatchInfo,
    num_slices: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """out [T, num_slices * R] <- x [T, in] @ A[slot, :num_slices*r].T (unscaled); see segmented_shrink."""
    return segmented_shrink(x, weights, batch_info, num_slices, out=out)
