"""Linear layers with fused projections and tensor-parallel-aware weight loading.

Every layer holds `weight` [output_size, input_size] (this rank's shard) and `bias` [output_size]
or None, and `forward(x)` returns one tensor. `input_size` / `output_size` are this rank's sizes,
i.e. the shape of `weight`; at tp_size == 1 (the only size built so far) they are the full sizes.

Each parameter carries `weight_loader(param, loaded_weight, shard_id=None)`, which copies a tensor
of the Hugging Face checkpoint (always the full, unsharded tensor) into the right place: this rank's
slice, and for fused layers the slice of the fused output named by `shard_id` ("q"/"k"/"v" for
QKVParallelLinear, 0/1 = gate/up for MergedColumnParallelLinear). The LoRA wrappers read
`input_size`, `output_size`, `weight`, `bias`, `q_proj_shard_size`, `kv_proj_shard_size` and
`output_sizes`; keep them.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

ShardId = Optional[Union[str, int]]


def _check_shape(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(
            f"checkpoint tensor for {what} has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}"
        )


class LinearBase(nn.Module):
    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        params_dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
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

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        params_dtype: Optional[torch.dtype] = None,
    ) -> None:
        self.full_output_size = output_size
        super().__init__(
            input_size, _split(output_size, tp_size, "output size"), bias, tp_rank, tp_size, params_dtype
        )

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        assert shard_id is None, "ColumnParallelLinear has no shards"
        n = param.shape[0]
        loaded = loaded_weight.narrow(0, self.tp_rank * n, n) if self.tp_size > 1 else loaded_weight
        _check_shape(param, loaded, type(self).__name__)
        param.data.copy_(loaded)


class RowParallelLinear(LinearBase):
    """Input features split across ranks (the partial outputs would be all-reduced under TP)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        params_dtype: Optional[torch.dtype] = None,
    ) -> None:
        self.full_input_size = input_size
        super().__init__(
            _split(input_size, tp_size, "input size"), output_size, bias, tp_rank, tp_size, params_dtype
        )

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        assert shard_id is None, "RowParallelLinear has no shards"
        loaded = loaded_weight
        if self.tp_size > 1 and loaded_weight.dim() == 2:  # the bias is not split
            n = param.shape[1]
            loaded = loaded_weight.narrow(1, self.tp_rank * n, n)
        _check_shape(param, loaded, type(self).__name__)
        param.data.copy_(loaded)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused along the output: [gate, up]."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        params_dtype: Optional[torch.dtype] = None,
    ) -> None:
        self.output_sizes = [_split(s, tp_size, "output size") for s in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias, tp_rank, tp_size, params_dtype)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        if shard_id is None:  # an already fused checkpoint tensor
            return ColumnParallelLinear.weight_loader(self, param, loaded_weight)
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id must be an index in 0..{len(self.output_sizes) - 1}, got {shard_id!r}")
        size = self.output_sizes[shard_id]
        offset = sum(self.output_sizes[:shard_id])
        loaded = loaded_weight.narrow(0, self.tp_rank * size, size) if self.tp_size > 1 else loaded_weight
        dst = param.data.narrow(0, offset, size)
        _check_shape(dst, loaded, f"{type(self).__name__} shard {shard_id}")
        dst.copy_(loaded)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused along the output in the order [q, k, v].

    Query heads are split across ranks; KV heads too, or replicated when there are fewer KV heads
    than ranks (each rank keeps the KV head its query heads attend to).
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: Optional[int] = None,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        params_dtype: Optional[torch.dtype] = None,
    ) -> None:
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = _split(total_num_heads, tp_size, "number of attention heads")
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = _split(tp_size, total_num_kv_heads, "tp_size over KV heads")
        else:
            self.num_kv_heads = _split(total_num_kv_heads, tp_size, "number of KV heads")
            self.num_kv_head_replicas = 1
        self.q_proj_shard_size = self.num_heads * head_size
        self.kv_proj_shard_size = self.num_kv_heads * head_size
        LinearBase.__init__(
            self,
            hidden_size,
            self.q_proj_shard_size + 2 * self.kv_proj_shard_size,
            bias,
            tp_rank,
            tp_size,
            params_dtype,
        )
        self.full_output_size = (total_num_heads + 2 * total_num_kv_heads) * head_size
        self.output_sizes = [self.q_proj_shard_size, self.kv_proj_shard_size, self.kv_proj_shard_size]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        if shard_id is None:
            raise ValueError("QKVParallelLinear loads q, k and v separately (shard_id 'q', 'k' or 'v')")
        if shard_id == "q":
            offset, size, rank = 0, self.q_proj_shard_size, self.tp_rank
        elif shard_id in ("k", "v"):
            size = self.kv_proj_shard_size
            offset = self.q_proj_shard_size + (size if shard_id == "v" else 0)
            rank = self.tp_rank // self.num_kv_head_replicas
        else:
            raise ValueError(f"shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        loaded = loaded_weight.narrow(0, rank * size, size) if self.tp_size > 1 else loaded_weight
        dst = param.data.narrow(0, offset, size)
        _check_shape(dst, loaded, f"{type(self).__name__} shard {shard_id!r}")
        dst.copy_(loaded)
