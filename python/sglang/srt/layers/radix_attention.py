"""The attention layer every model uses: store K/V in the pool, then call the backend."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from sglang.srt.layers.triton_ops.rope import KVStore
from sglang.srt.configs.forward_batch_info import ForwardBatch


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

    def kv_store(self, forward_batch: ForwardBatch) -> Optional[KVStore]:
        """This layer's pool buffers and the batch's slots, for a kernel that stores K/V itself
        (the fused RoPE kernel); None when the batch has no pool attached."""
        pool = forward_batch.token_to_kv_pool
        if pool is None:
            return None
        return KVStore(
            pool.get_key_buffer(self.layer_id), pool.get_value_buffer(self.layer_id), forward_batch.out_cache_loc
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """`save_kv_cache=False`: the caller already wrote K/V at `out_cache_loc`."""
        # Token-wise, so it stays inside a captured graph segment: padded tokens of a replay have
        # out_cache_loc 0 and write the dummy slot.
        if save_kv_cache:
            forward_batch.token_to_kv_pool.set_kv_buffer(self.layer_id, forward_batch.out_cache_loc, k, v)
        shape = (q.shape[0], self.tp_q_head_num * self.v_head_dim)
        breaker = forward_batch.graph_breaker
        if breaker is not None:
            # Breakable graph: attention depends on the live batch's per-request metadata, so it
            # runs eagerly between two captured segments, writing straight into the buffer the
            # next segment reads (no copy at the break).
            out = breaker.output_buffer(shape, q.dtype, q.device)
            return breaker.eager(self._attend, q, k, v, out)
        out = torch.empty(shape, dtype=q.dtype, device=q.device)
        return self._attend(forward_batch, q, k, v, out)

    def _attend(
        self,
        forward_batch: ForwardBatch,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
    ) -> torch.Tensor:
        result = forward_batch.attn_backend.forward(q, k, v, self, forward_batch, out=out)
        # `out` itself, not the backend's view of it: the breakable graph recognises the tensor
        # its next segment reads and copies nothing.
        return out if result.data_ptr() == out.data_ptr() and result.shape == out.shape else result
