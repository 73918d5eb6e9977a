"""Fused gate/up expand for the `triton` backend (two equal slices, one launch)."""

from __future__ import annotations

from typing import Optional

import torch

from sglang.srt.lora.triton_ops.sgemm_lora_b import segmented_expand
from sglang.srt.lora.utils import LoRABatchInfo


def gate_up_lora_b_fwd(
    x: torch.Tensor,
    gate_up_lora_b: torch.Tensor,
    batch_info: LoRABatchInfo,
    output_dim: int,
    base_output: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """x: shrink output [T, 2R]; gate_up_lora_b: [slots, 2 * output_dim, R].
    Adds the scaled gate and up slices into base_output [T, 2 * output_dim] in place."""
    assert gate_up_lora_b.shape[1] == 2 * output_dim, (gate_up_lora_b.shape, output_dim)
    return segmented_expand(x, gate_up_lora_b, batch_info, base_output, num_slices=2, permuted=False)
