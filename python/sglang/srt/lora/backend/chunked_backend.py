"""`csgmv` LoRA backend (chunked SGMV): tokens sorted by adapter, cut into fixed-size chunks.

Tokens of the same adapter slot become contiguous in a sorted order (`permutation`: sorted
position -> token row), whatever request they came from; each slot's run is cut into chunks of
`chunk` positions and every chunk is one segment (one program column of the grid). Chunks bound
the work per program, so a skewed adapter mix does not leave one giant program per adapter.
Runs of slots whose rank is 0 (the base model) get no chunk at all: they cost nothing.

Graph modes (decode and prefill) keep static buffers sized for the worst case of their token
capacity N: at most ceil(N / MIN_CHUNK_SIZE) full chunks plus one partial chunk per adapter. The
chunk size is forced to MIN_CHUNK_SIZE, and the grid's segment axis (`bs`) is that worst case for
the rows of the batch being prepared (`forward_batch.num_tokens`): at capture that is the padded
bucket, so the recorded grid covers any live batch the graph can serve, whose rows are at most the
bucket. The caller (graph runner) must therefore prepare the capture batch with the bucket's row
count. The refresh writes the live segments and gives every other segment of the buffer length 0
(and a rank-0 slot where the batch has one), so segments of an earlier, larger batch are never
re-applied (upstream bug #28371).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from sglang.srt.lora.backend._staging import copy_into, to_device
from sglang.srt.lora.backend.base_backend import BaseLoRABackend
from sglang.srt.lora.triton_ops import chunked_sgmv_lora_expand_forward, chunked_sgmv_lora_shrink_forward
from sglang.srt.lora.utils import LoRABatchInfo

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

MIN_CHUNK_SIZE = 16


@dataclass
class ChunkedSegments:
    """Host-side result of sorting and chunking one batch."""

    permutation: torch.Tensor  # int32 [T]: sorted position -> token row
    seg_indptr: list[int]  # [num_segments + 1] offsets into sorted positions
    weight_indices: list[int]  # [num_segments] slot of each chunk

    @property
    def num_segments(self) -> int:
        return len(self.weight_indices)


def build_chunked_segments(
    req_slots: list[int], req_num_tokens: list[int], lora_ranks: list[int], chunk: int
) -> ChunkedSegments:
    """Stable-sort tokens by slot and cut every active slot's run into chunks of `chunk`.

    Tokens of rank-0 slots (base requests) sort after every active slot and get no chunk, so the
    chunks stay one contiguous CSR range [0, active tokens) and base tokens cost nothing.
    """
    num_slots = len(lora_ranks)
    slots = torch.tensor(req_slots, dtype=torch.int64)
    active = torch.tensor(lora_ranks, dtype=torch.int64)[slots] > 0 if slots.numel() else slots.bool()
    keys = torch.where(active, slots, torch.full_like(slots, num_slots))
    lens = torch.tensor(req_num_tokens, dtype=torch.int64)
    if bool((lens != 1).any()):
        keys = torch.repeat_interleave(keys, lens)
    sorted_keys, permutation = torch.sort(keys, stable=True)
    seg_indptr = [0]
    seg_slots: list[int] = []
    if sorted_keys.numel() > 0:
        group_keys, group_sizes = torch.unique_consecutive(sorted_keys, return_counts=True)
        for slot, size in zip(group_keys.tolist(), group_sizes.tolist()):
            if slot == num_slots:  # the trailing rank-0 run
                break
            start = seg_indptr[-1]
            seg_indptr.extend(start + min(c + chunk, size) for c in range(0, size, chunk))
            seg_slots.extend([slot] * ((size + chunk - 1) // chunk))
    return ChunkedSegments(permutation.to(torch.int32), seg_indptr, seg_slots)


class ChunkedSgmvLoRABackend(BaseLoRABackend):
    name = "csgmv"
    supports_prefill_cuda_graph = True

    def __init__(
        self,
        max_loras_per_batch: int,
        device: torch.device | str,
        max_lora_chunk_size: int = 16,
    ) -> None:
        super().__init__(max_loras_per_batch, device, max_lora_chunk_size)
        self.max_chunk_size = max_lora_chunk_size
        self._decode_tokens_per_req: int = 1
        self._decode_max_tokens: Optional[int] = None
        # The contiguous int32 buffers behind each static info (seg_indptr | weight_indices |
        # lora_ranks), so one host->device copy refreshes all three.
        self._decode_meta: Optional[torch.Tensor] = None
        self._prefill_meta: Optional[torch.Tensor] = None

    # ---- kernels ---------------------------------------------------------------------------
    def run_lora_a_sgemm(self, x: torch.Tensor, weights: torch.Tensor, stack_num: int = 1) -> torch.Tensor:
        return chunked_sgmv_lora_shrink_forward(x, weights, self.batch_info, num_slices=stack_num)

    def run_lora_b_sgemm(
        self, x: torch.Tensor, weights: torch.Tensor, base_output: Optional[torch.Tensor]
    ) -> torch.Tensor:
        return chunked_sgmv_lora_expand_forward(x, weights, self.batch_info, base_output, num_slices=1)

    def run_qkv_lora(
        self,
        x: torch.Tensor,
        qkv_lora_a: torch.Tensor,
        qkv_lora_b: torch.Tensor,
        output_offset: torch.Tensor,
        max_qkv_out_dim: int,
        base_output: Optional[torch.Tensor],
    ) -> torch.Tensor:
        shrunk = chunked_sgmv_lora_shrink_forward(x, qkv_lora_a, self.batch_info, num_slices=3)
        return chunked_sgmv_lora_expand_forward(
            shrunk,
            qkv_lora_b,
            self.batch_info,
            base_output,
            num_slices=3,
            slice_offsets=output_offset,
            max_slice_size=max_qkv_out_dim,
        )

    def run_gate_up_lora(
        self,
        x: torch.Tensor,
        gate_up_lora_a: torch.Tensor,
        gate_up_lora_b: torch.Tensor,
        base_output: Optional[torch.Tensor],
    ) -> torch.Tensor:
        shrunk = chunked_sgmv_lora_shrink_forward(x, gate_up_lora_a, self.batch_info, num_slices=2)
        return chunked_sgmv_lora_expand_forward(shrunk, gate_up_lora_b, self.batch_info, base_output, num_slices=2)

    # ---- chunking --------------------------------------------------------------------------
    def chunk_size(self, num_tokens: int) -> int:
        """Eager chunk size: larger chunks for larger batches, capped by --max-lora-chunk-size."""
        if self.max_chunk_size <= MIN_CHUNK_SIZE:
            return MIN_CHUNK_SIZE
        if num_tokens >= 256:
            size = 128
        elif num_tokens >= 64:
            size = 32
        else:
            size = MIN_CHUNK_SIZE
        return min(self.max_chunk_size, size)

    def _segment_capacity(self, max_num_tokens: int) -> int:
        # Chunks of a slot's run: ceil(g / 16) <= g / 16 + 1; summed over <= mlpb slots.
        return max(math.ceil(max_num_tokens / MIN_CHUNK_SIZE) + self.max_loras_per_batch, 16)

    def _alloc_static_info(self, max_num_tokens: int) -> tuple[LoRABatchInfo, torch.Tensor]:
        cap = self._segment_capacity(max_num_tokens)
        mlpb = self.max_loras_per_batch
        dev = self.device
        # seg_indptr, weight_indices and lora_ranks share one buffer: one copy refreshes them.
        meta = torch.zeros(cap + 1 + cap + mlpb, dtype=torch.int32, device=dev)
        info = LoRABatchInfo(
            bs=cap,  # the grid spans the whole segment buffer
            num_segments=0,
            max_len=MIN_CHUNK_SIZE,
            seg_indptr=meta[: cap + 1],
            weight_indices=meta[cap + 1 : 2 * cap + 1],
            lora_ranks=meta[2 * cap + 1 :],
            scalings=torch.zeros(mlpb, dtype=torch.float32, device=dev),
            seg_lens=None,
            permutation=torch.zeros(max(max_num_tokens, 1), dtype=torch.int32, device=dev),
            use_cuda_graph=True,
        )
        return info, meta

    def init_cuda_graph_batch_info(self, max_bs_in_cuda_graph: int, num_tokens_per_bs: int = 1) -> None:
        self._decode_tokens_per_req = num_tokens_per_bs
        self._decode_max_tokens = max_bs_in_cuda_graph * num_tokens_per_bs
        self.cuda_graph_batch_info, self._decode_meta = self._alloc_static_info(self._decode_max_tokens)
        self.max_bs_in_cuda_graph = max_bs_in_cuda_graph

    def init_prefill_cuda_graph_batch_info(self, max_num_tokens: int) -> None:
        self.prefill_cuda_graph_batch_info, self._prefill_meta = self._alloc_static_info(max_num_tokens)
        # Chunks, not requests, fill the segment buffer: every request has >= 1 token, so the
        # token cap is also the request cap.
        self.prefill_cuda_graph_max_bs = max_num_tokens
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
        bs = forward_batch.batch_size
        assert len(weight_indices) == bs, (len(weight_indices), bs)
        if use_cuda_graph:
            assert self.cuda_graph_batch_info is not None, "init_cuda_graph_batch_info was not called"
            assert bs <= self.max_bs_in_cuda_graph, (bs, self.max_bs_in_cuda_graph)
            lens = [self._decode_tokens_per_req] * bs
            self._refresh_static_info(
                self.cuda_graph_batch_info,
                self._decode_meta,
                self._decode_max_tokens,
                max(forward_batch.num_tokens, sum(lens)),
                lens,
                weight_indices,
                lora_ranks,
                scalings,
            )
        elif use_prefill_cuda_graph:
            assert self.prefill_cuda_graph_batch_info is not None, "init_prefill_cuda_graph_batch_info was not called"
            assert forward_batch.forward_mode.is_extend(), forward_batch.forward_mode
            self._refresh_static_info(
                self.prefill_cuda_graph_batch_info,
                self._prefill_meta,
                self.prefill_cuda_graph_max_tokens,
                forward_batch.num_tokens,
                self._extend_lens(forward_batch),
                weight_indices,
                lora_ranks,
                scalings,
            )
        else:
            self._build_eager_info(forward_batch, weight_indices, lora_ranks, scalings)

    @staticmethod
    def _extend_lens(forward_batch: "ForwardBatch") -> list[int]:
        if forward_batch.forward_mode.is_extend():
            if forward_batch.extend_seq_lens_cpu is not None:
                return [int(n) for n in forward_batch.extend_seq_lens_cpu]
            # The sort runs on the host; without a host copy we must fetch it (one sync).
            return forward_batch.extend_seq_lens.tolist()
        return [1] * forward_batch.batch_size

    def _build_eager_info(
        self,
        forward_batch: "ForwardBatch",
        weight_indices: list[int],
        lora_ranks: list[int],
        scalings: list[float],
    ) -> None:
        lens = self._extend_lens(forward_batch)
        chunk = self.chunk_size(sum(lens) if forward_batch.forward_mode.is_extend() else len(lens))
        segs = build_chunked_segments(weight_indices, lens, lora_ranks, chunk)
        n = segs.num_segments
        num_tokens = segs.permutation.numel()
        packed = to_device(
            torch.cat(
                [
                    segs.permutation,
                    torch.tensor(segs.seg_indptr + segs.weight_indices + list(lora_ranks), dtype=torch.int32),
                ]
            ),
            torch.int32,
            self.device,
        )
        self.batch_info = LoRABatchInfo(
            bs=n,  # grid over the live chunks only; an all-base batch launches nothing
            num_segments=n,
            max_len=chunk,
            permutation=packed[:num_tokens],
            seg_indptr=packed[num_tokens : num_tokens + n + 1],
            weight_indices=packed[num_tokens + n + 1 : num_tokens + 2 * n + 1],
            lora_ranks=packed[num_tokens + 2 * n + 1 :],
            scalings=to_device(scalings, torch.float32, self.device),
            seg_lens=None,
            use_cuda_graph=False,
        )

    def _refresh_static_info(
        self,
        info: LoRABatchInfo,
        meta: torch.Tensor,
        max_tokens: int,
        num_rows: int,
        lens: list[int],
        weight_indices: list[int],
        lora_ranks: list[int],
        scalings: list[float],
    ) -> None:
        num_tokens = sum(lens)
        assert num_tokens <= num_rows <= max_tokens, (num_tokens, num_rows, max_tokens)
        # Graph mode: chunk size is frozen (it is the grid's token axis) for capture and replay.
        segs = build_chunked_segments(weight_indices, lens, lora_ranks, MIN_CHUNK_SIZE)
        n, cap = segs.num_segments, self._segment_capacity(max_tokens)
        assert n <= cap, (n, cap)
        # Neutralise the tail: zero length (offsets repeat the last one) and, where the batch
        # has one, a rank-0 slot, so an earlier larger batch's segments can never run again.
        idle_slot = next((s for s, r in enumerate(lora_ranks) if r == 0), 0)
        seg_indptr = segs.seg_indptr + [segs.seg_indptr[-1]] * (cap - n)
        seg_slots = segs.weight_indices + [idle_slot] * (cap - n)
        copy_into(meta, seg_indptr + seg_slots + list(lora_ranks))
        copy_into(info.scalings, scalings)
        if num_tokens > 0:
            copy_into(info.permutation[:num_tokens], segs.permutation)
        info.num_segments = n
        # The grid's segment axis covers the worst case for the rows of this batch, not the
        # whole buffer: at capture `num_rows` is the bucket, and any live batch replayed on that
        # graph has at most as many rows, hence at most this many chunks. Small buckets thus
        # launch small grids even though the buffer is sized for the largest one.
        info.bs = self._segment_capacity(num_rows)
        self.batch_info = info

