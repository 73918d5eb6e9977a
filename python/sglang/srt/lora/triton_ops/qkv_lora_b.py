"""Fused q/k/v expand for the `triton` backend (one launch for the three slices)."""

from __future__ import annotations

from typing import Optional

import torch

from sglang.srt.lora.triton_ops.sgemm_lora_b import segmented_expand
from sglang.srt.lora.utils import LoRABatchInfo


def qkv_lora_b_fwd(
    x: torch.Tensor,
    qkv_lora_b: torch.Tensor,
    batch_info: LoRABatchInfo,
    output_offset: torch.Tensor,
    max_qkv_out_dim: int,
    base_output: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """x: shrink output [T, 3R]; qkv_lora_b: [slots, q+2kv, R];
    output_offset: int32 device tensor [0, q, q+kv, q+2kv]; max_qkv_out_dim = max(q, kv).
    Adds the three scaled slices into base_output [T, q+2kv] in place and returns it."""
    return segmented_expand(
        x,
        qkv_lora_b,
        batch_info,
        base_output,
        num_slices=3,
        permuted=False,
        slice_offsets=output_offset,
        max_slice_width=max_qkv_out_dim,
    )
