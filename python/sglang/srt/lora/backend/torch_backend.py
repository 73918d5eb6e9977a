"""`torch_native` LoRA backend: plain torch per segment, driven by host-side metadata.

The reference for the Triton backends in tests. Its Python loop over segments freezes one batch's
structure if captured, so it runs eagerly only (no decode or prefill graph support).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from sglang.srt.configs.forward_path import ForwardPath
from sglang.srt.lora.backend._staging import to_device
from sglang.srt.lora.backend.base_backend import BaseLoRABackend
from sglang.srt.lora.utils import LoRABatchInfo, LoRAModuleWeights

if TYPE_CHECKING:
    from sglang.srt.configs.forward_batch_info import ForwardBatch


@dataclass
class _HostSegment:
    start: int
    end: int
    slot: int
    rank: int
    scaling: float


class TorchNativeLoRABackend(BaseLoRABackend):
    name = "torch_native"

    def __init__(
        self,
        max_loras_per_batch: int,
        device: torch.device | str,
        max_lora_chunk_size: int = 16,
    ) -> None:
        super().__init__(max_loras_per_batch, device, max_lora_chunk_size)
        # Only segments with rank > 0; consecutive requests of one slot are merged.
        self._segments: list[_HostSegment] = []

    # ---- the module call ---------------------------------------------------------------------
    def run_module(self, weights: LoRAModuleWeights, base_layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = base_layer(x)
        spec = weights.spec
        assert isinstance(weights.B, torch.Tensor), "torch_native reads plain pool buffers (never folded)"
        offsets = spec.slice_offsets
        for seg in self._segments:
            rows, r = slice(seg.start, seg.end), seg.rank
            # The shrink result in x's dtype, as a separate shrink kernel would store it.
            xa = (x[rows].float() @ weights.A[seg.slot, : spec.stack * r].float().T).to(x.dtype).float()
            for k in range(spec.stack):
                lo, hi = offsets[k], offsets[k + 1]
                delta = xa[:, k * r : (k + 1) * r] @ weights.B[seg.slot, lo:hi, :r].float().T
                out[rows, lo:hi] = (out[rows, lo:hi].float() + seg.scaling * delta).to(out.dtype)
        return out

    # ---- metadata --------------------------------------------------------------------------
    def fill_batch_info(
        self,
        forward_batch: "ForwardBatch",
        weight_indices: list[int],
        lora_ranks: list[int],
        scalings: list[float],
        path: ForwardPath,
    ) -> None:
        if path.is_graph:
            raise ValueError(
                "The torch_native LoRA backend runs eagerly only; it cannot serve CUDA graph batches."
            )
        bs = forward_batch.batch_size
        assert len(weight_indices) == bs, (len(weight_indices), bs)
        lens = self._request_lens(forward_batch)

        segments: list[_HostSegment] = []
        seg_lens: list[int] = []
        seg_slots: list[int] = []
        start = 0
        for slot, n in zip(weight_indices, lens):
            n = int(n)
            if seg_slots and seg_slots[-1] == slot:
                seg_lens[-1] += n
            else:
                seg_slots.append(slot)
                seg_lens.append(n)
        for slot, n in zip(seg_slots, seg_lens):
            rank = int(lora_ranks[slot])
            if rank > 0 and n > 0:
                segments.append(_HostSegment(start, start + n, slot, rank, float(scalings[slot])))
            start += n
        self._segments = segments

        # Device metadata for the layers' `batch_info is not None` check and for inspection.
        indptr = [0]
        for n in seg_lens:
            indptr.append(indptr[-1] + n)
        dev = self.device
        self.batch_info = LoRABatchInfo(
            num_rows=forward_batch.num_tokens,
            lora_ranks=to_device(lora_ranks, torch.int32, dev),
            scalings=to_device(scalings, torch.float32, dev),
            bs=len(seg_slots),
            num_segments=len(seg_slots),
            max_len=max(seg_lens, default=0),
            seg_indptr=to_device(indptr, torch.int32, dev),
            weight_indices=to_device(seg_slots, torch.int32, dev),
            seg_lens=to_device(seg_lens, torch.int32, dev),
        )
