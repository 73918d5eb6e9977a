"""The attention layer every model uses: store K/V in the pool, then call the backend."""

from __future__ import annotations

import torch
from torch import nn

from sglang.srt.model_executor.forward_batch_info import ForwardBatch


class RadixAttention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scaling: float,
        num_kv_heads: int,
        layer_id: int,
    ) -> None:
        super().__init__()
        self.tp_q_head_num = num_heads
        self.tp_k_head_num = num_kv_heads
        self.tp_v_head_num = num_kv_heads
        self.head_dim = head_dim
        self.qk_head_dim = head_dim
        self.v_head_dim = head_dim
        self.scaling = scaling
        self.layer_id = layer_id

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        # Token-wise, so it stays inside a captured graph segment: padded tokens of a replay have
        # out_cache_loc 0 and write the dummy slot.
        forward_batch.token_to_kv_pool.set_kv_buffer(self.layer_id, forward_batch.out_cache_loc, k, v)
        if forward_batch.graph_breaker is not None:
            # Breakable graph: attention depends on the live batch's per-request metadata, so it
            # runs eagerly between two captured segments.
            return forward_batch.graph_breaker.eager(self._attend, q, k, v)
        return self._attend(forward_batch, q, k, v)

    def _attend(
        self, forward_batch: ForwardBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch)
