"""`torch_native` LoRA backend: plain torch per segment, driven by host-side metadata.

The reference for the Triton backends in tests. Its Python loop over segments freezes one batch's
structure if captured, so it runs eagerly only (no decode or prefill graph support).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from sglang.srt.lora.backend._staging import to_device
from sglang.srt.lora.backend.base_backend import BaseLoRABackend
from sglang.srt.lora.utils import LoRABatchInfo

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch


@dataclass
class _HostSegment:
    start: int
    end: int
    slot: int
    rank: int
    scaling: float


class TorchNativeLoRABackend(BaseLoRABackend):
    name = "torch_native"
    supports_prefill_cuda_graph = False

    def __init__(
        self,
        max_loras_per_batch: int,
        device: torch.device | str,
        max_lora_chunk_size: int = 16,
    ) -> None:
        super().__init__(max_loras_per_batch, device, max_lora_chunk_size)
        # Only segments with rank > 0; consecutive requests of one slot are merged.
        self._segments: list[_HostSegment] = []

    # ---- kernels ---------------------------------------------------------------------------
    def run_lora_a_sgemm(self, x: torch.Tensor, weights: torch.Tensor, stack_num: int = 1) -> torch.Tensor:
        out = torch.zeros((x.shape[0], weights.shape[1]), dtype=x.dtype, device=x.device)
        for seg in self._segments:
            cols = stack_num * seg.rank
            rows = slice(seg.start, seg.end)
            shrunk = x[rows].float() @ weights[seg.slot, :cols].float().T
            out[rows, :cols] = shrunk.to(out.dtype)
        return out

    def _expand(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        base_output: Optional[torch.Tensor],
        slice_bounds: list[tuple[int, int]],
    ) -> torch.Tensor:
        if base_output is None:
            base_output = torch.zeros((x.shape[0], weights.shape[1]), dtype=x.dtype, device=x.device)
        for seg in self._segments:
            rows = slice(seg.start, seg.end)
            r = seg.rank
            for k, (lo, hi) in enumerate(slice_bounds):
                delta = x[rows, k * r : (k + 1) * r].float() @ weights[seg.slot, lo:hi, :r].float().T
                updated = base_output[rows, lo:hi].float() + seg.scaling * delta
                base_output[rows, lo:hi] = updated.to(base_output.dtype)
        return base_output

    def run_lora_b_sgemm(
        self, x: torch.Tensor, weights: torch.Tensor, base_output: Optional[torch.Tensor]
    ) -> torch.Tensor:
        return self._expand(x, weights, base_output, [(0, weights.shape[1])])

    def run_qkv_lora(
        self,
        x: torch.Tensor,
        qkv_lora_a: torch.Tensor,
        qkv_lora_b: torch.Tensor,
        output_offset: torch.Tensor,
        max_qkv_out_dim: int,
        base_output: Optional[torch.Tensor],
    ) -> torch.Tensor:
        off = [int(v) for v in output_offset.tolist()]  # a sync; acceptable for the reference
        shrunk = self.run_lora_a_sgemm(x, qkv_lora_a, stack_num=3)
        return self._expand(shrunk, qkv_lora_b, base_output, [(off[i], off[i + 1]) for i in range(3)])

    def run_gate_up_lora(
        self,
        x: torch.Tensor,
        gate_up_lora_a: torch.Tensor,
        gate_up_lora_b: torch.Tensor,
        base_output: Optional[torch.Tensor],
    ) -> torch.Tensor:
        half = gate_up_lora_b.shape[1] // 2
        shrunk = self.run_lora_a_sgemm(x, gate_up_lora_a, stack_num=2)
        return self._expand(shrunk, gate_up_lora_b, base_output, [(0, half), (half, 2 * half)])

    # ---- metadata --------------------------------------------------------------------------
    def prepare_lora_batch(
        self,
        forward_batch: "ForwardBatch",
        weight_indices: list[int],
        lora_ranks: list[int],
        scalings: list[float],
        use_cuda_graph: bool,
        use_prefill_cuda_graph: bool = False,
    ) -> None:
        if use_cuda_graph or use_prefill_cuda_graph:
            raise ValueError(
                "The torch_native LoRA backend runs eagerly only; it cannot serve CUDA graph batches."
            )
        bs = forward_batch.batch_size
        assert len(weight_indices) == bs, (len(weight_indices), bs)
        if forward_batch.forward_mode.is_extend():
            lens = forward_batch.extend_seq_lens_cpu
            if lens is None:
                lens = forward_batch.extend_seq_lens.tolist()
        else:
            lens = [1] * bs

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
            bs=len(seg_slots),
            num_segments=len(seg_slots),
            max_len=max(seg_lens, default=0),
            seg_indptr=to_device(indptr, torch.int32, dev),
            weight_indices=to_device(seg_slots, torch.int32, dev),
            lora_ranks=to_device(lora_ranks, torch.int32, dev),
            scalings=to_device(scalings, torch.float32, dev),
            seg_lens=to_device(seg_lens, torch.int32, dev),
            use_cuda_graph=False,
        )
