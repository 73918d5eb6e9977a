"""The attention layer every model uses: store K/V in the pool, then call the backend.

Under torch.compile (the tc_piecewise prefill graph) attention is one opaque custom op,
`sglang::radix_attention`, that the compiled code calls at run time: Dynamo traces the whole body
as one graph, inductor fuses everything but attention, and attention runs as written (eagerly,
breaking the captured graph where it does). The op reads the batch and the layers from the
`attention_context` the caller opens around the compiled body.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import nn

from sglang.srt.configs.forward_batch_info import ForwardBatch
from sglang.srt.layers.triton_ops.rope import KVStore

# (forward batch, layer id -> RadixAttention) of the compiled body running now; None otherwise.
_context: Optional[tuple[ForwardBatch, dict[int, "RadixAttention"]]] = None


@contextlib.contextmanager
def attention_context(forward_batch: ForwardBatch, layers: dict[int, "RadixAttention"]) -> Iterator[None]:
    """What `sglang::radix_attention` reads while a compiled body runs (the caller's batch and
    its model's attention layers, by layer id)."""
    global _context
    previous, _context = _context, (forward_batch, layers)
    try:
        yield
    finally:
        _context = previous


# The op writes into `out`, a buffer the compiled code allocates, rather than returning one: inductor
# reuses a dead buffer for a later tensor of the same size, so an output the op handed back from
# memory of its own (the breakable graph's shared break buffer) could come back to it as the next
# layer's q. Writing into the caller's buffer keeps every address inductor's to plan.
@torch.library.custom_op("sglang::radix_attention", mutates_args=("out",))
def radix_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer_id: int,
                       save_kv_cache: bool) -> None:
    assert _context is not None, "sglang::radix_attention runs only inside attention_context"
    forward_batch, layers = _context
    layers[layer_id].attend_eagerly(q, k, v, forward_batch, save_kv_cache, out=out)


@radix_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer_id: int,
      save_kv_cache: bool) -> None:
    return None


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
        if torch.compiler.is_compiling():
            out = q.new_empty((q.shape[0], self.tp_q_head_num * self.v_head_dim))
            torch.ops.sglang.radix_attention(q, k, v, out, self.layer_id, save_kv_cache)
            return out
        return self.attend_eagerly(q, k, v, forward_batch, save_kv_cache)

    def attend_eagerly(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Attention as written (no compile). `out`: write the result there (the compiled body's
        buffer); otherwise into a buffer of the breakable graph's or a new one."""
        # Token-wise, so it stays inside a captured graph segment: padded tokens of a replay have
        # out_cache_loc 0 and write the dummy slot.
        if save_kv_cache:
            forward_batch.token_to_kv_pool.set_kv_buffer(self.layer_id, forward_batch.out_cache_loc, k, v)
        shape = (q.shape[0], self.tp_q_head_num * self.v_head_dim)
        breaker = forward_batch.graph_breaker
        if out is not None:
            if breaker is not None:
                breaker.eager_into(self._attend_into, out, q, k, v)
            else:
                self._attend_into(forward_batch, q, k, v, out)
            return out
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

    def _attend_into(self, forward_batch: ForwardBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor) -> None:
        result = self._attend(forward_batch, q, k, v, out)
        if result is not out:
            out.copy_(result.view(out.shape))
