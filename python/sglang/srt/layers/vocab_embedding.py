"""Token embedding and the LM head, split over the vocabulary for tensor parallelism.

The vocabulary is padded up to a multiple of tp_size; rank r holds the rows
[r * per_rank, (r + 1) * per_rank) of the padded table (padding rows are zero).
- VocabParallelEmbedding: each rank looks up the ids of its range (others give zero rows) and an
  all-reduce sums the ranks' rows, so every rank ends with the full embedding.
- ParallelLMHead: each rank computes the logits of its vocabulary range, and an all-gather along
  the vocabulary puts the full [N, vocab_size] logits on every rank, so sampling and logprobs are
  identical everywhere (the padding columns are sliced off).
At tp_size 1 both are the plain operations.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.distributed import SINGLE_RANK, TensorParallelGroup
from sglang.srt.model_loader.weight_utils import LoadedWeight, ShardId, load_into
from sglang.srt.utils import cdiv


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        params_dtype: Optional[torch.dtype] = None,
        *,
        tp_group: TensorParallelGroup = SINGLE_RANK,
    ) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.tp_rank, self.tp_size = self.tp_group.rank, self.tp_group.size
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_padded = cdiv(num_embeddings, self.tp_size) * self.tp_size
        self.num_embeddings_per_partition = self.num_embeddings_padded // self.tp_size
        # This rank's real (unpadded) vocabulary range [start, end); empty for an all-padding rank.
        self.vocab_start_index = min(self.tp_rank * self.num_embeddings_per_partition, num_embeddings)
        self.vocab_end_index = min(self.vocab_start_index + self.num_embeddings_per_partition, num_embeddings)
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_partition, embedding_dim, dtype=dtype), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader
        self.weight.full_shape = (num_embeddings, embedding_dim)

    def weight_loader(self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: ShardId = None) -> None:
        assert shard_id is None
        if tuple(loaded_weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"checkpoint tensor for {type(self).__name__} has shape {tuple(loaded_weight.shape)}, "
                f"expected {(self.num_embeddings, self.embedding_dim)} (vocab_size x hidden_size)"
            )
        n = self.vocab_end_index - self.vocab_start_index
        load_into(param.data[:n], loaded_weight.narrow(0, self.vocab_start_index, n), type(self).__name__)
        param.data[n:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_range = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)
        local_ids = torch.where(in_range, input_ids - self.vocab_start_index, 0)
        rows = F.embedding(local_ids, self.weight)
        rows.masked_fill_(~in_range.unsqueeze(-1), 0)  # other ranks own these ids
        return self.tp_group.all_reduce(rows)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_rank}/{self.tp_size}"


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection hidden -> vocab. The LogitsProcessor calls `compute_logits`; it is
    never called as an embedding."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, vocab_size] in the weight's dtype, the same on every rank."""
        logits = torch.matmul(hidden, self.weight.t())
        if self.tp_size == 1:
            return logits
        logits = self.tp_group.all_gather(logits, dim=-1)
        return logits[:, : self.num_embeddings] if self.num_embeddings_padded != self.num_embeddings else logits

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # pragma: no cover - misuse guard
        raise RuntimeError("ParallelLMHead is applied by LogitsProcessor, not called directly")
