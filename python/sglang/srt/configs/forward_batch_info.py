"""What one forward pass sees: the mode and the batch as device tensors (plain data, at the bottom
of the layers: the model runner fills it, attention, LoRA and the models read it).

The scheduler turns its `ScheduleBatch` into a `ForwardBatch`; the model runner, the attention
backends, the LoRA manager and the graph runners read nothing else. Everything here is a tensor
or a small host-side list; no Python objects of requests leak below this line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum, auto
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

if TYPE_CHECKING:
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo


class ForwardMode(IntEnum):
    EXTEND = auto()  # prefill, possibly over a cached prefix (chunked prefill)
    DECODE = auto()  # one new token per request
    IDLE = auto()  # nothing to run (kept for symmetry with multi-rank runs)

    def is_extend(self) -> bool:
        return self == ForwardMode.EXTEND

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE

    def is_cuda_graph(self) -> bool:
        """Modes served by the decode graph family (never EXTEND)."""
        return self in (ForwardMode.DECODE, ForwardMode.IDLE)


class GraphBreaker:
    """The seam through which a layer asks for an eager call inside a breakable graph.

    `RadixAttention` calls `forward_batch.graph_breaker.eager(fn, *tensors)` instead of `fn` when a
    breakable capture or replay is in progress; the breakable graph (runner/breakable_cuda_graph.py)
    implements it. `fn(forward_batch, *tensors)` must return a tensor. At replay the breaker calls
    `fn` with the *live* forward batch, so attention reads live metadata. The output is valid
    until the next `eager` call: the breakable graph keeps every break's output in one buffer.
    """

    def eager(self, fn: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def eager_into(self, fn: Callable[..., None], out: torch.Tensor, *tensors: torch.Tensor) -> None:
        """Like `eager`, for a `fn(forward_batch, *tensors, out)` that writes into the caller's `out`
        (a buffer the captured code allocated and reads next), so the break keeps no output."""
        raise NotImplementedError

    def output_buffer(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Where the next `eager` call should write its output (so the break copies nothing)."""
        return torch.empty(shape, dtype=dtype, device=device)


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    # Token-wise tensors, length T (= extend_num_tokens in EXTEND, batch_size in DECODE).
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    out_cache_loc: torch.Tensor  # int64 [T]: KV slot each token writes; slot 0 is the dummy slot
    # Request-wise tensors, length B.
    req_pool_indices: torch.Tensor  # int64 [B]: row of each request in ReqToTokenPool
    seq_lens: torch.Tensor  # int64 [B]: total length after this pass (prefix + new tokens)
    seq_lens_cpu: torch.Tensor  # int64 [B] on the host
    # EXTEND only (None in DECODE).
    extend_seq_lens: Optional[torch.Tensor] = None  # int64 [B]: new tokens per request
    extend_prefix_lens: Optional[torch.Tensor] = None  # int64 [B]: cached tokens per request
    extend_start_loc: Optional[torch.Tensor] = None  # int64 [B]: offset of each request in the T axis
    extend_seq_lens_cpu: Optional[list[int]] = None
    extend_prefix_lens_cpu: Optional[list[int]] = None
    extend_num_tokens: Optional[int] = None

    # LoRA: None when LoRA is off; one entry per request otherwise (None = base model).
    lora_ids: Optional[list[Optional[str]]] = None
    # Adapters of requests outside this batch that stay resident with it (a prefill's decoding
    # requests: the pool sees one batch at a time and would otherwise evict them only to load
    # them back at the next decode step).
    keep_lora_ids: frozenset = frozenset()

    # Logprobs. `return_logprob` is True if any request asked. Per request (EXTEND):
    # `extend_logprob_start_lens[i]` is the first position *within this pass's new tokens* whose
    # next-token logprob is wanted, and `extend_logprob_target_ids[i]` holds the prompt token that
    # follows each of those positions (it can belong to the next chunk). Positions with no prompt
    # successor (the last prompt token) are not listed: that logprob is the sampled token's.
    return_logprob: bool = False
    return_logprob_per_req: Optional[list[bool]] = None
    top_logprobs_nums: Optional[list[int]] = None
    extend_logprob_start_lens: Optional[list[int]] = None
    extend_logprob_target_ids: Optional[list[list[int]]] = None

    sampling_info: Optional["SamplingBatchInfo"] = None

    # Owned by the model runner; filled by ModelRunner before the forward. Typed loosely: the pools
    # (mem_cache/memory_pool.py) and the attention backend (layers/attention/) live in the layers
    # above this plain data, which must not import them.
    req_to_token_pool: Any = None  # ReqToTokenPool
    token_to_kv_pool: Any = None  # MHATokenToKVPool
    attn_backend: Any = None  # AttentionBackend

    # Set only inside a breakable graph's capture/replay (see GraphBreaker).
    graph_breaker: Optional[GraphBreaker] = None
    # Free-form per-backend metadata slot (attention backends keep their own state instead).
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
