"""LoRA batch metadata and module descriptions shared by the backends and their kernels (DESIGN §5)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass
class LoRABatchInfo:
    """Which adapter slot each token row of the batch uses, as segments.

    A *segment* is a run of rows, in the order the kernels read them (`permutation`: position ->
    row), that share one slot. Token-major backends (`triton`, `csgmv`; lora/segments.py) put every
    row of the batch in exactly one segment of at most `max_len` rows: active adapters' rows
    grouped by slot, then the rest (base model, rank-0 slots, padding) under a rank-0 slot. Kernels
    read the slot's rank first: rank 0 gets nothing added. `torch_native` keeps request-ordered
    segments (no permutation) for the rows with an adapter.

    `bs` is the grid's segment axis: the live segments eagerly; under a CUDA graph the capacity of
    the bucket being prepared (frozen at capture), unused segments empty. `num_rows` is the row
    count of the batch being prepared (at capture: the bucket), the kernels' row bound. Under a
    graph the segment tensors are static buffers refreshed in place.

    `lora_ranks` and `scalings` are per slot; for the token-major backends they are the pool's
    device tensors (updated when a slot changes, not per forward).
    """

    num_rows: int
    lora_ranks: torch.Tensor  # int32 [num_slots]: rank of each slot's adapter, 0 = none
    scalings: torch.Tensor  # float32 [num_slots]: alpha / r (or alpha / sqrt(r) for rsLoRA)
    use_cuda_graph: bool = False  # metadata lives in static buffers a graph reads
    bs: int = 0  # size of the grid's segment axis
    num_segments: int = 0  # live segments (<= bs); informational under graphs
    max_len: int = 0  # segment size (token-major) or longest segment (torch_native)
    seg_indptr: Optional[torch.Tensor] = None  # int32 [bs + 1]: CSR offsets, seg_indptr[0] == 0
    weight_indices: Optional[torch.Tensor] = None  # int32 [bs]: pool slot of each segment
    seg_lens: Optional[torch.Tensor] = None  # int32 [bs] (torch_native)
    permutation: Optional[torch.Tensor] = None  # int32 [>= num_rows]: position -> token row
    # int32 [>= num_rows]: each row's slot (-1: none). Decode batches only, with the norm fused
    # into the folded modules' shrink_pack (lora/norm_fusion.py); None otherwise.
    row_slots: Optional[torch.Tensor] = None
    # Whether o_proj's and down_proj's shrinks run row by row in this batch (SGLANG_LORA_ROWWISE_DECODE,
    # backend/token_backend.py); decided when the batch is prepared (at capture: for the bucket).
    rowwise: bool = False
    # Whether A-folded o_proj / down_proj leave their delta to the fused norm after them
    # (SGLANG_LORA_AFOLD, backend/token_backend.py); decided like `rowwise`.
    defer: bool = False


@dataclass(frozen=True)
class LoRAModuleSpec:
    """One kind of wrapped module (e.g. every layer's qkv_proj), as the backend sees it."""

    name: str  # "qkv_proj", "o_proj", "gate_up_proj", "down_proj"
    in_dim: int
    slice_sizes: tuple[int, ...]  # output slices in order, e.g. (q, kv, kv)
    max_rank: int
    extra_cols: int = 0  # E of W_aug when folded (lora/fold.py); 0 = separate shrink and expand
    # A's row stride in elements: in_dim, or in_dim + E when A lives inside W_aug's buffer (the
    # A-fold, lora/fold.py a_fold_views); 0 reads as in_dim. Launches prepared per batch bake it in.
    a_row_stride: int = 0

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
    # A-folded (o_proj, down_proj; lora/fold.py): [W; A of every adapter slot] [out + S_a*R, in], a
    # view of W_aug's buffer whose GEMM also writes every slot's shrink, and B transposed [slots, R, out].
    a_folded: Optional[torch.Tensor] = None
    bt: Optional[torch.Tensor] = None


@dataclass
class DeferredDelta:
    """The LoRA delta an A-folded module leaves to the norm after it (lora/norm_fusion.py):
    `shrink` [T, S_a*max_rank] the unscaled x @ A^T of every adapter slot (its GEMM's last columns;
    row t uses its slot's block), `bt` [slots, max_rank, out] each slot's B transposed (rank rows
    past an adapter's rank are never read), `scalings` [slots] float32."""

    shrink: torch.Tensor
    bt: torch.Tensor
    scalings: torch.Tensor
    max_rank: int


@dataclass
class DeferredExpand:
    """The expand an unfolded gate_up_proj leaves to the SiLU-and-mul after it (csgmv,
    SGLANG_LORA_EXPAND_SILU): `xa` [T, 2*max_rank] its rows' compact, unscaled shrink; the module's B
    and the batch's segments are the backend's."""

    xa: torch.Tensor


@dataclass
class PreparedInput:
    """What a fused norm (lora/norm_fusion.py) wrote for the module it feeds: the normalised rows
    (the norm's output, which the module is then called with) and the module's shrink, as x_aug
    [normed | packed shrink] for a folded module (`normed` is its view), as xa (compact, unscaled)
    for an unfolded one."""

    normed: torch.Tensor
    x_aug: Optional[torch.Tensor] = None
    xa: Optional[torch.Tensor] = None
    # The norm (or activation) wrote only `normed`, x_aug's first columns (the copy shrink_pack
    # would make is already there): the module still launches shrink_pack, without the copy.
    pack_pending: bool = False
