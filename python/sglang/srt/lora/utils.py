"""LoRA batch metadata and module descriptions shared by the backends and their kernels (DESIGN §5)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass
class LoRABatchInfo:
    """Which adapter slot each token row of the batch uses.

    Token-major (`triton`, `csgmv`): `token_slots[t]` is row t's pool slot, -1 for rows outside
    every request (padding of a graph bucket). Kernels read the slot's rank first: rank 0 (the base
    model, an empty slot) and -1 rows get nothing added. Under a CUDA graph `token_slots` is a
    static buffer refreshed in place, and `num_rows` is the row count of the batch being prepared
    (at capture: the bucket), which only sizes grids.

    `lora_ranks` and `scalings` are per slot; for the token-major backends they are the pool's
    device tensors (updated when a slot changes, not per forward).

    Segments (csgmv's chunked fallback kernels, torch_native): a *segment* is a run of rows, in the
    order the kernels read them (`permutation`: sorted position -> row), that share one slot.
    `bs` is the grid's segment axis (frozen at capture under graphs), unused segments have length 0.
    """

    num_rows: int
    token_slots: Optional[torch.Tensor]  # int32 [>= num_rows]
    lora_ranks: torch.Tensor  # int32 [num_slots]: rank of each slot's adapter, 0 = none
    scalings: torch.Tensor  # float32 [num_slots]: alpha / r (or alpha / sqrt(r) for rsLoRA)
    use_cuda_graph: bool = False  # metadata lives in static buffers a graph reads
    bs: int = 0  # size of the grid's segment axis
    num_segments: int = 0  # live segments (<= bs); informational under graphs
    max_len: int = 0  # chunk size (csgmv) or longest segment: the grid's token axis
    seg_indptr: Optional[torch.Tensor] = None  # int32 [bs + 1]: CSR offsets, seg_indptr[0] == 0
    weight_indices: Optional[torch.Tensor] = None  # int32 [bs]: pool slot of each segment
    seg_lens: Optional[torch.Tensor] = None  # int32 [bs]
    permutation: Optional[torch.Tensor] = None  # int32 [T]: sorted position -> token row (csgmv)


@dataclass(frozen=True)
class LoRAModuleSpec:
    """One kind of wrapped module (e.g. every layer's qkv_proj), as the backend sees it."""

    name: str  # "qkv_proj", "o_proj", "gate_up_proj", "down_proj"
    in_dim: int
    slice_sizes: tuple[int, ...]  # output slices in order, e.g. (q, kv, kv)
    max_rank: int
    extra_cols: int = 0  # E of W_aug when folded (lora/fold.py); 0 = separate shrink and expand

    @property
    def stack(self) -> int:
        return len(self.slice_sizes)

    @property
    def out_dim(self) -> int:
        return sum(self.slice_sizes)

    @property
    def folded(self) -> bool:
        return self.extra_cols > 0

    @property
    def equal_slices(self) -> bool:
        return len(set(self.slice_sizes)) == 1

    @property
    def slice_offsets(self) -> list[int]:
        offsets = [0]
        for size in self.slice_sizes:
            offsets.append(offsets[-1] + size)
        return offsets


@dataclass
class LoRAModuleWeights:
    """One wrapped module of one layer: the pool's views of its adapters and its base weights."""

    spec: LoRAModuleSpec
    A: torch.Tensor  # [slots, c*R, in]
    B: Any  # [slots, out, R]: a tensor, or a fold.SlicedB inside `folded`
    bias: Optional[torch.Tensor]
    folded: Optional[torch.Tensor] = None  # W_aug [out, in + E] when folded
