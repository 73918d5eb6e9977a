"""Linear layers with fused projections, sharded for tensor parallelism.

Every layer holds `weight` [output_size, input_size] (this rank's shard) and `bias` [output_size]
or None, and `forward(x)` returns one tensor. `input_size` / `output_size` are this rank's sizes,
i.e. the shape of `weight`; `full_input_size` / `full_output_size` are the unsharded ones.

Tensor parallelism (DESIGN §11): a layer belongs to the `TensorParallelGroup` its constructor is
given (`tp_group`, default SINGLE_RANK: the whole layer; `.layout_only(rank, size)` builds a shard
without a live group), and reads its `tp_rank` / `tp_size` from it.
- Column-parallel layers (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear)
  split the output: each rank computes its slice of the output features, nothing is communicated.
  QKV splits the heads; KV heads are replicated when there are fewer KV heads than ranks.
- RowParallelLinear splits the input: each rank multiplies its slice of the input features by its
  columns of the weight, and the partial outputs are summed over the ranks by an all-reduce.
  `forward` = `forward_partial` (local matmul, bias added on rank 0 only) then `reduce`
  (the all-reduce), two seams so that a LoRA wrapper adds its own partial delta between them.

Each parameter carries `weight_loader(param, loaded_weight, shard_id=None)`, which copies this
rank's slice of a full, unsharded checkpoint tensor into place: for fused layers the part of the
fused output named by `shard_id` ("q"/"k"/"v" for QKVParallelLinear, 0/1 = gate/up for
MergedColumnParallelLinear), or with `shard_id=None` a whole fused tensor (the layout of the
unsharded parameter, as the dummy initialiser makes it). `loaded_weight` is a torch.Tensor or a
lazy checkpoint slice (anything with `shape`, `narrow` and `materialize()`): loaders only narrow
it, so a rank reads just its slice from disk. The LoRA wrappers read `input_size`, `output_size`,
`weight`, `bias`, `q_proj_shard_size`, `kv_proj_shard_size`, `output_sizes`, `tp_rank`, `tp_size`
and `tp_group`; keep them.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from sglang.srt.distributed import SINGLE_RANK, TensorParallelGroup
from sglang.srt.layers.triton_ops.gemv import linear
from sglang.srt.model_loader.weight_utils import LoadedWeight, ShardId, check_rows, load_into


class LinearBase(nn.Module):
    """A linear layer of `input_size` x `output_size` features (the full, unsharded sizes) of which
    this rank holds the part its subclass's `split` names: "output" (column-parallel), "input"
    (row-parallel), or None (whole). `local_output_size` overrides the split output size of a
    fused layer whose parts split unevenly (QKV under GQA)."""

    split: Optional[str] = None

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        *,
        tp_group: TensorParallelGroup = SINGLE_RANK,
        local_output_size: Optional[int] = None,
    ) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.tp_rank = self.tp_group.rank
        self.tp_size = self.tp_group.size
        self.full_input_size = input_size
        self.full_output_size = output_size
        self.input_size = _split(input_size, self.tp_size, "input size") if self.split == "input" else input_size
        self.output_size = local_output_size or (
            _split(output_size, self.tp_size, "output size") if self.split == "output" else output_size
        )
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(self.output_size, self.input_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        # The unsharded parameter's shape: what the dummy initialiser generates and hands to the
        # weight_loader (shard_id None), so every tp_size gets slices of the same tensors.
        self.weight.full_shape = (self.full_output_size, self.full_input_size)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
            self.bias.full_shape = (self.full_output_size,)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)  # F.linear, or a one-row GEMV (triton_ops/gemv.py)

    def weight_loader(self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: ShardId = None) -> None:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}, "
            f"tp={self.tp_rank}/{self.tp_size}"
        )


def _split(total: int, tp_size: int, what: str) -> int:
    if total % tp_size != 0:
        raise ValueError(f"{what} ({total}) is not divisible by tp_size ({tp_size})")
    return total // tp_size


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks: rank r holds rows [r*out/tp, (r+1)*out/tp)."""

    split = "output"

    def output_partition(self) -> list[tuple[int, int]]:
        """(start, length) in the full, unsharded output of each block of rows this rank holds, in
        the order of its local output features. A tensor laid out like the full fused output (a
        checkpoint tensor, or a LoRA B stacked [q; k; v] / [gate; up]) is sharded with it."""
        return [(self.tp_rank * self.output_size, self.output_size)]

    def _load_full(self, param: nn.Parameter, loaded: LoadedWeight) -> None:
        """Load this rank's rows of a tensor laid out like the full (fused) output."""
        what = type(self).__name__
        check_rows(loaded, self.full_output_size, what)
        local = 0
        for start, n in self.output_partition():
            load_into(param.data.narrow(0, local, n), loaded.narrow(0, start, n), what)
            local += n

    def weight_loader(self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: ShardId = None) -> None:
        assert shard_id is None, "ColumnParallelLinear has no shards"
        self._load_full(param, loaded_weight)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; the partial outputs are summed by an all-reduce.

    `forward(x)` = `reduce(forward_partial(x))`. The bias is added on rank 0 only, before the
    all-reduce, so it is counted once. With `reduce_results=False` the caller does the all-reduce.
    """

    split = "input"

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *, reduce_results: bool = True,
                 **kwargs: Any) -> None:
        """kwargs: LinearBase's (`params_dtype`, `tp_group`)."""
        self.reduce_results = reduce_results
        super().__init__(input_size, output_size, bias, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.forward_partial(x))

    @property
    def partial_bias(self) -> Optional[torch.Tensor]:
        """The bias this rank's partial output carries: the whole bias on rank 0, none elsewhere."""
        return self.bias if self.tp_rank == 0 else None

    def forward_partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial output (x: [..., input_size], this rank's input slice): summed over
        the ranks it is the full output."""
        return linear(x, self.weight, self.partial_bias)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial outputs, in place (identity at tp_size 1 or reduce_results=False)."""
        if self.tp_size == 1 or not self.reduce_results:
            return partial
        return self.tp_group.all_reduce(partial)

    def input_partition(self) -> tuple[int, int]:
        """(start, length) of this rank's input features in the full input: the columns of a full
        weight (or of a LoRA A) that it holds."""
        return self.tp_rank * self.input_size, self.input_size

    def weight_loader(self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: ShardId = None) -> None:
        assert shard_id is None, "RowParallelLinear has no shards"
        loaded = loaded_weight
        if len(loaded_weight.shape) == 2:  # the bias is not split
            loaded = loaded_weight.narrow(1, *self.input_partition())
        load_into(param.data, loaded, type(self).__name__)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused along the output: [gate, up].
    Rank r holds [gate_r, up_r], the r-th slice of each."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        *,
        tp_group: TensorParallelGroup = SINGLE_RANK,
    ) -> None:
        self.full_output_sizes = list(output_sizes)
        self.output_sizes = [_split(s, tp_group.size, "output size") for s in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias, params_dtype=params_dtype, tp_group=tp_group)

    def output_partition(self) -> list[tuple[int, int]]:
        offsets = [sum(self.full_output_sizes[:i]) for i in range(len(self.full_output_sizes))]
        return [(off + self.tp_rank * n, n) for off, n in zip(offsets, self.output_sizes)]

    def weight_loader(self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: ShardId = None) -> None:
        if shard_id is None:  # a whole fused [gate; up] tensor
            return self._load_full(param, loaded_weight)
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id must be an index in 0..{len(self.output_sizes) - 1}, got {shard_id!r}")
        size = self.output_sizes[shard_id]
        offset = sum(self.output_sizes[:shard_id])
        dst = param.data.narrow(0, offset, size)
        what = f"{type(self).__name__} shard {shard_id}"
        check_rows(loaded_weight, self.full_output_sizes[shard_id], what)
        load_into(dst, loaded_weight.narrow(0, self.tp_rank * size, size), what)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused along the output in the order [q, k, v].

    Query heads are split across ranks; KV heads too, or replicated when there are fewer KV heads
    than ranks (rank r keeps KV head r // (tp_size / num_kv_heads), the one its query heads use).
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: Optional[int] = None,
        bias: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        *,
        tp_group: TensorParallelGroup = SINGLE_RANK,
    ) -> None:
        tp = tp_group.size
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = _split(total_num_heads, tp, "number of attention heads")
        if tp >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = _split(tp, total_num_kv_heads, "tp_size over KV heads")
        else:
            self.num_kv_heads = _split(total_num_kv_heads, tp, "number of KV heads")
            self.num_kv_head_replicas = 1
        self.q_proj_shard_size = self.num_heads * head_size
        self.kv_proj_shard_size = self.num_kv_heads * head_size
        super().__init__(
            hidden_size, (total_num_heads + 2 * total_num_kv_heads) * head_size, bias, params_dtype,
            tp_group=tp_group, local_output_size=self.q_proj_shard_size + 2 * self.kv_proj_shard_size,
        )
        self.output_sizes = [self.q_proj_shard_size, self.kv_proj_shard_size, self.kv_proj_shard_size]

    @property
    def kv_head_rank(self) -> int:
        """Which slice of the KV heads this rank holds (ranks sharing a replicated head agree)."""
        return self.tp_rank // self.num_kv_head_replicas

    def output_partition(self) -> list[tuple[int, int]]:
        q_full, kv_full = self.total_num_heads * self.head_size, self.total_num_kv_heads * self.head_size
        q, kv, kv_rank = self.q_proj_shard_size, self.kv_proj_shard_size, self.kv_head_rank
        return [(self.tp_rank * q, q), (q_full + kv_rank * kv, kv), (q_full + kv_full + kv_rank * kv, kv)]

    def weight_loader(self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: ShardId = None) -> None:
        if shard_id is None:  # a whole fused [q; k; v] tensor
            return self._load_full(param, loaded_weight)
        if shard_id == "q":
            offset, size, rank = 0, self.q_proj_shard_size, self.tp_rank
        elif shard_id in ("k", "v"):
            size = self.kv_proj_shard_size
            offset = self.q_proj_shard_size + (size if shard_id == "v" else 0)
            rank = self.kv_head_rank
        else:
            raise ValueError(f"shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        dst = param.data.narrow(0, offset, size)
        what = f"{type(self).__name__} shard {shard_id!r}"
        full = (self.total_num_heads if shard_id == "q" else self.total_num_kv_heads) * self.head_size
        check_rows(loaded_weight, full, what)
        load_into(dst, loaded_weight.narrow(0, rank * size, size), what)
