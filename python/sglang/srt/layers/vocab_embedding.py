"""Token embedding and the LM head (vocab-parallel layout, built for tp_size == 1).

Under tensor parallelism each rank would hold a contiguous range of vocabulary rows; the loaders
below already take that rank's slice of the full checkpoint tensor.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        params_dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        if num_embeddings % tp_size != 0:
            raise ValueError(f"vocab size {num_embeddings} is not divisible by tp_size {tp_size}")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.num_embeddings_per_partition = num_embeddings // tp_size
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_partition, embedding_dim, dtype=dtype), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        assert shard_id is None
        n = self.num_embeddings_per_partition
        loaded = loaded_weight.narrow(0, self.tp_rank * n, n) if self.tp_size > 1 else loaded_weight
        if tuple(loaded.shape) != tuple(param.shape):
            raise ValueError(
                f"checkpoint tensor for {type(self).__name__} has shape {tuple(loaded.shape)}, "
                f"expected {tuple(param.shape)} (vocab_size x hidden_size)"
            )
        param.data.copy_(loaded)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_rank}/{self.tp_size}"


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection hidden -> vocab. Its weight is read by the LogitsProcessor; it is
    never called as an embedding."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # pragma: no cover - misuse guard
        raise RuntimeError("ParallelLMHead is applied by LogitsProcessor, not called directly")
