"""The attention backend interface (DESIGN §4).

A backend computes attention for `RadixAttention` layers. K/V of the new tokens are already in the
KV pool when `forward` is called (RadixAttention writes them first), and are also passed as `k`, `v`
for backends that prefer to read them directly.

Shapes: `q` is [T, num_heads * head_dim] (T may exceed the live token count inside a padded graph
replay: rows past the live tokens are ignored), `k`/`v` are [T, num_kv_heads * head_dim], the output
is [T, num_heads * head_dim]. q, k and v may be strided views of one fused qkv tensor (rows
contiguous). When `out` is given the backend writes the output there and returns it (RadixAttention
passes the buffer the next graph segment reads); otherwise it allocates one.

Graph hooks:
  init_cuda_graph_state(max_bs, max_num_tokens)   allocate static metadata buffers once
  init_forward_metadata_capture_cuda_graph(...)    point the metadata at the static buffers (capture)
  init_forward_metadata_replay_cuda_graph(...)     copy the live batch's metadata into them (replay)
A backend that cannot be captured leaves them raising NotImplementedError.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Optional

import torch

from sglang.srt.configs.forward_batch_info import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention


class AttentionBackend(ABC):
    @abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Prepare whatever the kernels need for this (eager) batch."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: "RadixAttention",
        forward_batch: ForwardBatch,
        out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, out=out)
        return self.forward_extend(q, k, v, layer, forward_batch, out=out)

    @abstractmethod
    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: "RadixAttention",
        forward_batch: ForwardBatch,
        out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor: ...

    @abstractmethod
    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: "RadixAttention",
        forward_batch: ForwardBatch,
        out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor: ...

    # ---- CUDA graph hooks -------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_capture_cuda_graph(
        self,
        bs: int,
        num_tokens: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        forward_mode: ForwardMode,
        forward_batch: ForwardBatch,
    ) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_replay_cuda_graph(
        self,
        bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        forward_mode: ForwardMode,
        forward_batch: ForwardBatch,
    ) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """seq_len given to padded decode rows of a graph replay."""
        return 1
