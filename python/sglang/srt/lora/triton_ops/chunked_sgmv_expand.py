"""Chunked-SGMV expand (`csgmv` backend): rows gathered and scattered through the permutation."""

from __future__ import annotations

from typing import Optional

import torch

from sglang.srt.lora.triton_ops.sgemm_lora_b import segmented_expand
from sglang.srt.lora.utils import LoRABatchInfo


def chunked_sgmv_lora_expand_forward(
    x: torch.Tensor,
    weights: torch.Tensor,
    batch_info: LoRABatchInfo,
    base_output: torch.Tensor,
    num_slices: int = 1,
    slice_offsets: Optional[torch.Tensor] = None,
    max_slice_size: Optional[int] = None,
    slice_stride: int = 0,
    x_slot_stride: int = 0,
    use_pdl: bool = False,
) -> torch.Tensor:
    """base_output[t, slice k] += scaling * x[t, k*r:(k+1)*r] @ B[slot, slice k, :r].T, in place.

    `slice_offsets` (int device tensor [num_slices + 1], with `max_slice_size`) gives unequal
    slices (qkv under GQA); None means `num_slices` equal slices of B's output dimension.
    `slice_stride`, `x_slot_stride`: see segmented_expand (a folded module's B read in place inside
    W_aug; x holding every slot's shrink); `use_pdl`: launched as a programmatic dependent (see
    sgemm_lora_b.PDL_MAX_ROWS).
    """
    return segmented_expand(
        x,
        weights,
        batch_info,
        base_output,
        num_slices=num_slices,
        slice_offsets=slice_offsets,
        max_slice_width=max_slice_size,
        slice_stride=slice_stride,
        x_slot_stride=x_slot_stride,
        use_pdl=use_pdl,
    )
