"""`csgmv` LoRA backend (chunked SGMV): the token-major backend, whose UNFOLDED modules run the
chunked SGMV kernels.

Folded modules (the usual case, see lora/fold.py) are the same as `triton`'s: shrink_pack + one
GEMM, reading `token_slots`. What differs is the fallback for modules over the fold bound (many
slots x high rank) or with `--lora-fold off`: tokens are sorted by adapter (`permutation`: sorted
position -> token row), whatever request they came from, and each slot's run is cut into chunks of
`--max-lora-chunk-size` positions; every chunk is one segment (one program column of the grid).
Adapters' weight tiles are then shared across requests, which pays off on long prefills; the
host-side sort and the ordinary Triton launches cost more per batch than `triton`'s fallback.
Runs of rank-0 slots (the base model) get no chunk at all. The chunk metadata is built only when
some module is unfolded.

The chunk size is the same eagerly and under graphs, and the shrink is not split (each chunk's
program reduces all of K), so a graph replay and an eager pass add the same bits. Graph modes keep
static segment buffers sized for the worst case of their token capacity N: ceil(N / chunk) full
chunks plus one partial chunk per slot; the grid's segment axis (`bs`) is that worst case for the
rows of the batch being prepared (at capture: the bucket). The refresh writes the live segments and
gives every other segment length 0 and a rank-0 slot, so segments of an earlier, larger batch are
never re-applied (upstream bug #28371).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.lora.backend._staging import copy_into, to_device
from sglang.srt.lora.backend.token_backend import TokenLoRABackend, _ModuleLaunches
from sglang.srt.lora.triton_ops import chunked_sgmv_lora_expand_forward, chunked_sgmv_lora_shrink_forward
from sglang.srt.lora.utils import LoRABatchInfo, LoRAModuleSpec, LoRAModuleWeights


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


class ChunkedSgmvLoRABackend(TokenLoRABackend):
    name = "csgmv"

    def __init__(
        self,
        max_loras_per_batch: int,
        device: torch.device | str,
        max_lora_chunk_size: int = 16,
        use_pdl: Optional[bool] = None,
    ) -> None:
        super().__init__(max_loras_per_batch, device, max_lora_chunk_size, use_pdl)
        # The contiguous int32 buffers behind each static info's segments (seg_indptr |
        # weight_indices), so one host->device copy refreshes both; and their token capacity.
        self._static_meta: dict[int, tuple[torch.Tensor, int]] = {}  # id(info) -> (meta, max rows)

    def _uses_token_kernels(self, spec: LoRAModuleSpec) -> bool:
        return False

    @property
    def _has_unfolded(self) -> bool:
        return any(not s.folded for s in self.specs.values())

    def _segment_capacity(self, max_num_tokens: int) -> int:
        # Chunks of a slot's run: ceil(g / chunk) <= g / chunk + 1; summed over every slot.
        return max(math.ceil(max_num_tokens / self.max_lora_chunk_size) + self._slot_ranks.numel(), 16)

    # ---- static infos ------------------------------------------------------------------------
    def _alloc_segments(self, info: LoRABatchInfo, max_num_tokens: int) -> None:
        if not self._has_unfolded:
            return
        cap = self._segment_capacity(max_num_tokens)
        meta = torch.zeros(2 * cap + 1, dtype=torch.int32, device=self.device)
        info.bs, info.max_len = cap, self.max_lora_chunk_size  # the grid spans the whole segment buffer
        info.seg_indptr, info.weight_indices = meta[: cap + 1], meta[cap + 1 :]
        info.permutation = torch.zeros(max(max_num_tokens, 1), dtype=torch.int32, device=self.device)
        self._static_meta[id(info)] = (meta, max_num_tokens)

    def init_cuda_graph_batch_info(self, max_bs_in_cuda_graph: int, num_tokens_per_bs: int = 1) -> None:
        super().init_cuda_graph_batch_info(max_bs_in_cuda_graph, num_tokens_per_bs)
        self._alloc_segments(self.cuda_graph_batch_info, max_bs_in_cuda_graph * num_tokens_per_bs)

    def init_prefill_cuda_graph_batch_info(self, max_num_tokens: int) -> None:
        super().init_prefill_cuda_graph_batch_info(max_num_tokens)
        self._alloc_segments(self.prefill_cuda_graph_batch_info, max_num_tokens)

    # ---- per-forward metadata ----------------------------------------------------------------
    def _prepare_segments(
        self,
        info: LoRABatchInfo,
        lens: list[int],
        weight_indices: list[int],
        lora_ranks: list[int],
        static: bool,
    ) -> None:
        if not self._has_unfolded:
            return
        segs = build_chunked_segments(weight_indices, lens, lora_ranks, self.max_lora_chunk_size)
        n, num_tokens = segs.num_segments, segs.permutation.numel()
        info.num_segments = n
        if not static:
            packed = to_device(
                torch.cat([segs.permutation, torch.tensor(segs.seg_indptr + segs.weight_indices, dtype=torch.int32)]),
                torch.int32,
                self.device,
            )
            info.bs, info.max_len = n, self.max_lora_chunk_size  # grid over the live chunks; all-base: nothing
            info.permutation = packed[:num_tokens]
            info.seg_indptr = packed[num_tokens : num_tokens + n + 1]
            info.weight_indices = packed[num_tokens + n + 1 :]
            return
        meta, max_tokens = self._static_meta[id(info)]
        num_rows = info.num_rows
        assert num_tokens <= num_rows <= max_tokens, (num_tokens, num_rows, max_tokens)
        cap = self._segment_capacity(max_tokens)
        assert n <= cap, (n, cap)
        # Neutralise the tail: zero length (offsets repeat the last one) and, where the batch
        # has one, a rank-0 slot, so an earlier larger batch's segments can never run again.
        idle_slot = next((s for s, r in enumerate(lora_ranks) if r == 0), 0)
        copy_into(meta, segs.seg_indptr + [segs.seg_indptr[-1]] * (cap - n) + segs.weight_indices + [idle_slot] * (cap - n))
        if num_tokens > 0:
            copy_into(info.permutation[:num_tokens], segs.permutation)
        # The grid's segment axis covers the worst case for the rows of this batch, not the whole
        # buffer: at capture `num_rows` is the bucket, and any live batch replayed on that graph
        # has at most as many rows, hence at most this many chunks.
        info.bs = self._segment_capacity(num_rows)

    # ---- unfolded modules --------------------------------------------------------------------
    def _add_unfolded(self, weights: LoRAModuleWeights, x: torch.Tensor, out: torch.Tensor,
                      launches: _ModuleLaunches) -> None:
        spec, info = weights.spec, self.batch_info
        xa = self._scratch.matrix(x.shape[0], spec.stack * spec.max_rank)
        # `out` given: one program per chunk reduces all of K (no split, no atomics, no memset).
        chunked_sgmv_lora_shrink_forward(x, weights.A, info, num_slices=spec.stack, out=xa)
        offsets = self._slice_offsets.get(spec.name)
        chunked_sgmv_lora_expand_forward(
            xa, weights.B, info, out, num_slices=spec.stack, slice_offsets=offsets,
            max_slice_size=max(spec.slice_sizes) if offsets is not None else None,
        )
