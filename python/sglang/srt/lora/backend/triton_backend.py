"""`triton` LoRA backend: one segment per request, segmented shrink/expand kernels.

Three places the metadata can live (BaseLoRABackend.prepare_lora_batch):
  eager                        a fresh info per forward; grid = (token lanes x column tiles, bs)
  decode graph (static)        `init_cuda_graph_batch_info`: seg_lens/seg_indptr fixed (every
                               request has `num_tokens_per_bs` tokens); slots/ranks/scalings
                               refreshed in place
  prefill graph (static)       `init_prefill_cuda_graph_batch_info`: PREFILL_CUDA_GRAPH_LORA_SEGMENTS
                               segment slots, every one always in the grid; unused ones length 0

Each program walks the token tiles of its segment in a loop (triton_ops/_tiles.py), so a grid
recorded once covers a segment of any length; `max_len` only picks the tile height and lanes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from sglang.srt.lora.backend._staging import copy_into, to_device
from sglang.srt.lora.backend.base_backend import BaseLoRABackend
from sglang.srt.lora.triton_ops import (
    gate_up_lora_b_fwd,
    qkv_lora_b_fwd,
    sgemm_lora_a_fwd,
    sgemm_lora_b_fwd,
)
from sglang.srt.lora.utils import LoRABatchInfo

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

# Segment slots of the prefill graph's static info. One segment per request, so this caps the
# requests a LoRA batch may have to replay the prefill graph (larger batches run eagerly). Small,
# because every captured LoRA kernel launches programs for all of them; unused ones exit at once.
PREFILL_CUDA_GRAPH_LORA_SEGMENTS = 32


class TritonLoRABackend(BaseLoRABackend):
    name = "triton"
    supports_prefill_cuda_graph = True

    # ---- kernels ---------------------------------------------------------------------------
    def run_lora_a_sgemm(self, x: torch.Tensor, weights: torch.Tensor, stack_num: int = 1) -> torch.Tensor:
        return sgemm_lora_a_fwd(x, weights, self.batch_info, stack_num)

    def run_lora_b_sgemm(
        self, x: torch.Tensor, weights: torch.Tensor, base_output: Optional[torch.Tensor]
    ) -> torch.Tensor:
        return sgemm_lora_b_fwd(x, weights, self.batch_info, base_output)

    def run_qkv_lora(
        self,
        x: torch.Tensor,
        qkv_lora_a: torch.Tensor,
        qkv_lora_b: torch.Tensor,
        output_offset: torch.Tensor,
        max_qkv_out_dim: int,
        base_output: Optional[torch.Tensor],
    ) -> torch.Tensor:
        shrunk = sgemm_lora_a_fwd(x, qkv_lora_a, self.batch_info, stack_num=3)
        return qkv_lora_b_fwd(shrunk, qkv_lora_b, self.batch_info, output_offset, max_qkv_out_dim, base_output)

    def run_gate_up_lora(
        self,
        x: torch.Tensor,
        gate_up_lora_a: torch.Tensor,
        gate_up_lora_b: torch.Tensor,
        base_output: Optional[torch.Tensor],
    ) -> torch.Tensor:
        shrunk = sgemm_lora_a_fwd(x, gate_up_lora_a, self.batch_info, stack_num=2)
        output_dim = gate_up_lora_b.shape[1] // 2
        return gate_up_lora_b_fwd(shrunk, gate_up_lora_b, self.batch_info, output_dim, base_output)

    # ---- static infos ----------------------------------------------------------------------
    def init_cuda_graph_batch_info(self, max_bs_in_cuda_graph: int, num_tokens_per_bs: int = 1) -> None:
        """Decode graph: every request has exactly `num_tokens_per_bs` tokens, so the segment
        layout is fixed once here; only slots, ranks and scalings change per batch."""
        max_bs = max_bs_in_cuda_graph
        dev = self.device
        seg_lens = torch.full((max_bs,), num_tokens_per_bs, dtype=torch.int32, device=dev)
        seg_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=dev)
        torch.cumsum(seg_lens, dim=0, dtype=torch.int32, out=seg_indptr[1:])
        self.cuda_graph_batch_info = LoRABatchInfo(
            bs=max_bs,
            num_segments=max_bs,
            max_len=num_tokens_per_bs,
            seg_indptr=seg_indptr,
            weight_indices=torch.zeros(max_bs, dtype=torch.int32, device=dev),
            lora_ranks=torch.zeros(self.max_loras_per_batch, dtype=torch.int32, device=dev),
            scalings=torch.zeros(self.max_loras_per_batch, dtype=torch.float32, device=dev),
            seg_lens=seg_lens,
            use_cuda_graph=True,
        )
        self.max_bs_in_cuda_graph = max_bs

    def init_prefill_cuda_graph_batch_info(self, max_num_tokens: int) -> None:
        """Prefill graph: PREFILL_CUDA_GRAPH_LORA_SEGMENTS segment slots, all ranks 0 until a
        batch is written in place (so a capture before any refresh records no-op kernels)."""
        n = PREFILL_CUDA_GRAPH_LORA_SEGMENTS
        dev = self.device
        self.prefill_cuda_graph_batch_info = LoRABatchInfo(
            bs=n,
            num_segments=n,
            # Covers every bucket until the first refresh sets the batch's own row count.
            max_len=max_num_tokens,
            seg_indptr=torch.zeros(n + 1, dtype=torch.int32, device=dev),
            weight_indices=torch.zeros(n, dtype=torch.int32, device=dev),
            lora_ranks=torch.zeros(self.max_loras_per_batch, dtype=torch.int32, device=dev),
            scalings=torch.zeros(self.max_loras_per_batch, dtype=torch.float32, device=dev),
            seg_lens=torch.zeros(n, dtype=torch.int32, device=dev),
            use_cuda_graph=True,
        )
        self.prefill_cuda_graph_max_bs = n
        self.prefill_cuda_graph_max_tokens = max_num_tokens

    # ---- per-forward metadata --------------------------------------------------------------
    def prepare_lora_batch(
        self,
        forward_batch: "ForwardBatch",
        weight_indices: list[int],
        lora_ranks: list[int],
        scalings: list[float],
        use_cuda_graph: bool,
        use_prefill_cuda_graph: bool = False,
    ) -> None:
        """Fill `self.batch_info` (see the module docstring for the three destinations).

        Prefill graph rule for `max_len` (it sizes the grid's token axis, frozen at capture): it
        is set to `forward_batch.num_tokens`, the number of token rows of the batch being
        prepared. The prefill graph runner must therefore prepare its *capture* batch with
        input_ids padded to the bucket (as the bucket's static buffers are), so the recorded grid
        is sized for segments of up to `bucket` rows; every live segment replayed on that graph
        has at most live tokens <= bucket rows, so it fits. (Each program walks its segment's
        token tiles in a loop, so coverage never depends on max_len; max_len only sets how many
        lanes, and which tile height, the captured grid uses.) At replay the Python value matters
        only if the static info is consumed eagerly, and num_tokens >= every live segment then too.
        """
        bs = forward_batch.batch_size
        assert len(weight_indices) == bs, (len(weight_indices), bs)
        if use_cuda_graph:
            self._refresh_decode_graph_info(bs, weight_indices, lora_ranks, scalings)
        elif use_prefill_cuda_graph:
            self._refresh_prefill_graph_info(forward_batch, weight_indices, lora_ranks, scalings)
        else:
            self._build_eager_info(forward_batch, weight_indices, lora_ranks, scalings)

    def _build_eager_info(
        self,
        forward_batch: "ForwardBatch",
        weight_indices: list[int],
        lora_ranks: list[int],
        scalings: list[float],
    ) -> None:
        bs = forward_batch.batch_size
        dev = self.device
        if forward_batch.forward_mode.is_extend():
            lens_cpu = forward_batch.extend_seq_lens_cpu
            if lens_cpu is not None:
                max_len = max(lens_cpu, default=0)
            else:
                # No host copy: bound the token axis by the row count instead of syncing.
                lens_cpu = None
                max_len = forward_batch.num_tokens
        else:
            lens_cpu = [1] * bs
            max_len = 1 if bs > 0 else 0

        if lens_cpu is not None:
            # One host->device copy carries every int32 array of this info.
            indptr = [0] * (bs + 1)
            for i, n in enumerate(lens_cpu):
                indptr[i + 1] = indptr[i] + int(n)
            packed = to_device(
                list(weight_indices) + list(lens_cpu) + indptr + list(lora_ranks), torch.int32, dev
            )
            wi = packed[:bs]
            seg_lens = packed[bs : 2 * bs]
            seg_indptr = packed[2 * bs : 3 * bs + 1]
            ranks = packed[3 * bs + 1 :]
        else:
            seg_lens = forward_batch.extend_seq_lens.to(device=dev, dtype=torch.int32)
            seg_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=dev)
            torch.cumsum(seg_lens, dim=0, dtype=torch.int32, out=seg_indptr[1:])
            wi = to_device(weight_indices, torch.int32, dev)
            ranks = to_device(lora_ranks, torch.int32, dev)
        self.batch_info = LoRABatchInfo(
            bs=bs,
            num_segments=bs,
            max_len=max_len,
            seg_indptr=seg_indptr,
            weight_indices=wi,
            lora_ranks=ranks,
            scalings=to_device(scalings, torch.float32, dev),
            seg_lens=seg_lens,
            use_cuda_graph=False,
        )

    def _refresh_decode_graph_info(
        self, bs: int, weight_indices: list[int], lora_ranks: list[int], scalings: list[float]
    ) -> None:
        info = self.cuda_graph_batch_info
        assert info is not None, "init_cuda_graph_batch_info must run before a decode graph batch"
        assert bs <= self.max_bs_in_cuda_graph, (bs, self.max_bs_in_cuda_graph)
        # `bs` is the grid's segment axis: at capture it is the bucket size, and the replayed
        # graph keeps that grid. Rows [bs, bucket) of a replay are padding; they keep stale slot
        # ids, which is harmless because their outputs are discarded.
        info.bs = info.num_segments = bs
        copy_into(info.weight_indices[:bs], weight_indices)
        copy_into(info.lora_ranks, lora_ranks)
        copy_into(info.scalings, scalings)
        self.batch_info = info

    def _refresh_prefill_graph_info(
        self,
        forward_batch: "ForwardBatch",
        weight_indices: list[int],
        lora_ranks: list[int],
        scalings: list[float],
    ) -> None:
        info = self.prefill_cuda_graph_batch_info
        assert info is not None, "init_prefill_cuda_graph_batch_info must run before a prefill graph batch"
        assert forward_batch.forward_mode.is_extend(), forward_batch.forward_mode
        bs = forward_batch.batch_size
        # The manager's predicate keeps larger batches eager; more requests than segment slots
        # would silently drop adapters.
        assert bs <= PREFILL_CUDA_GRAPH_LORA_SEGMENTS, (bs, PREFILL_CUDA_GRAPH_LORA_SEGMENTS)
        num_tokens = forward_batch.num_tokens
        assert num_tokens <= self.prefill_cuda_graph_max_tokens, (
            num_tokens,
            self.prefill_cuda_graph_max_tokens,
        )
        # `bs` stays pinned at PREFILL_CUDA_GRAPH_LORA_SEGMENTS: the recorded grids span all slots.
        info.num_segments = bs
        info.max_len = max(num_tokens, 1)  # see prepare_lora_batch's docstring for this rule
        info.seg_lens[:bs].copy_(forward_batch.extend_seq_lens, non_blocking=True)
        info.seg_lens[bs:].zero_()
        # seg_indptr[0] stays 0 from allocation; computed on the device, no sync.
        torch.cumsum(info.seg_lens, dim=0, dtype=torch.int32, out=info.seg_indptr[1:])
        # Stale slot ids past `bs` are harmless: their segments have length 0.
        copy_into(info.weight_indices[:bs], weight_indices)
        copy_into(info.lora_ranks, lora_ranks)
        copy_into(info.scalings, scalings)
        self.batch_info = info
