"""The `triton` attention backend: our own extend and split-KV decode kernels, capturable in graphs.

Metadata is a handful of device tensors per batch (request rows, lengths, start offsets) plus, in
eager extend, the longest extend length taken from the host-side list (no device sync).

CUDA graphs (see base_attn_backend.py). Both graph families keep their per-request metadata in
static buffers owned here, sized once for every request row the pool has, so they never move:
  - decode graph: grid `(captured bs, KVH, num_kv_splits)`; at replay padded rows get the runner's
    padding request row (row 0 if it has none) and `get_cuda_graph_seq_len_fill_value()`, so they
    compute a harmless one-token attention whose output the runner drops;
  - full prefill graph: grid `(request slots, H, cdiv(token bucket, BLOCK_M))`; at replay unused
    slots become zero-length sentinels (seq_len 0, extend_len 0), which the kernel skips.
Scratch tensors (decode partial outputs) are allocated inside the forward: under capture they land in
the graph's private pool and stay valid for its replays, like any other intermediate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.attention.triton_ops.decode_attention import (
    decode_attention_fwd,
    default_num_kv_splits,
)
from sglang.srt.layers.attention.triton_ops.extend_attention import extend_attention_fwd
from sglang.srt.configs.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.utils import stacked_view

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention


@dataclass
class TritonAttnMetadata:
    req_pool_indices: torch.Tensor  # [B] (graph: the captured request axis)
    seq_lens: torch.Tensor  # [B]
    extend_seq_lens: Optional[torch.Tensor] = None  # EXTEND only
    extend_start_loc: Optional[torch.Tensor] = None  # EXTEND only
    # Bound on the extend lengths, sizing the grid's token axis. None: span q's rows (a graph,
    # where q holds the whole token bucket and no host value of the live batch may be baked in).
    max_extend_len: Optional[int] = None
    # Decode split-KV partials (part_o, part_lse), allocated by the first layer of a forward and
    # reused by the others: one allocation per forward, not per layer.
    decode_scratch: Optional[tuple[torch.Tensor, torch.Tensor]] = None


@dataclass
class _StaticBuffers:
    """Fixed-address per-request metadata read by captured kernels (int64, like ForwardBatch)."""

    # The rows of `rows` [4, capacity]: a batch whose req_pool_indices and seq_lens lie back to
    # back (the batch builders' one packed copy) fills the first two with one copy.
    rows: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    extend_seq_lens: torch.Tensor
    extend_start_loc: torch.Tensor
    # Host-side mark: rows from here on hold the padding values, so a fill resets only the rows
    # a larger batch wrote since (in steady decode, none: no padding kernels per step).
    live_rows: int = 0

    @classmethod
    def allocate(cls, capacity: int, device: torch.device) -> "_StaticBuffers":
        # Rows padded to 16 elements (128 bytes): every row starts as aligned as its own tensor would.
        rows = torch.zeros(4, -(-capacity // 16) * 16, dtype=torch.int64, device=device)[:, :capacity]
        return cls(rows, rows[0], rows[1], rows[2], rows[3])

    def load_requests(self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> int:
        """Copy the live requests' rows and lengths into the prefixes; returns their count."""
        n = int(req_pool_indices.numel())
        live = stacked_view(req_pool_indices, seq_lens)
        if live is not None:
            self.rows[:2, :n].copy_(live, non_blocking=True)
        else:
            self.req_pool_indices[:n].copy_(req_pool_indices, non_blocking=True)
            self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        return n

    @property
    def capacity(self) -> int:
        return int(self.seq_lens.numel())


def _exclusive_cumsum(lens: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(lens, dim=0) - lens


class TritonAttnBackend(AttentionBackend):
    def __init__(
        self,
        model_runner,
        num_kv_splits: Optional[int] = None,
        extend_kv_from_input: bool = True,
    ) -> None:
        """`num_kv_splits` (power of two) fixes the decode grid's split axis for the backend's
        life; `extend_kv_from_input` lets extend read the new tokens' K/V from this pass's k/v
        tensors (same values as the pool, without the slot indirection)."""
        self.device = torch.device(model_runner.device)
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        # Request row given to padded decode rows of a replay: the runner's padding row when it
        # reserves one (every position -> dummy slot 0), else row 0, which always exists.
        self.padding_req_row = int(getattr(model_runner, "padding_req_pool_index", 0) or 0)
        self.num_kv_splits = num_kv_splits or default_num_kv_splits(
            self.device, self.token_to_kv_pool.head_num
        )
        if self.num_kv_splits & (self.num_kv_splits - 1):
            raise ValueError(f"num_kv_splits must be a power of two, got {self.num_kv_splits}")
        self.extend_kv_from_input = extend_kv_from_input
        self.forward_metadata: Optional[TritonAttnMetadata] = None
        self._decode_bufs: Optional[_StaticBuffers] = None
        self._extend_bufs: Optional[_StaticBuffers] = None
        # Fewest request slots any full prefill graph was captured with: a replay may not exceed it.
        self._extend_slots: Optional[int] = None
        self._captured = False

    # ------------------------------------------------------------------ eager metadata
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        mode = fb.forward_mode
        if mode.is_decode():
            self.forward_metadata = TritonAttnMetadata(fb.req_pool_indices, fb.seq_lens)
        elif mode.is_extend():
            if fb.extend_seq_lens is None:
                raise ValueError("an EXTEND batch needs extend_seq_lens")
            start_loc = fb.extend_start_loc
            if start_loc is None:
                start_loc = _exclusive_cumsum(fb.extend_seq_lens)
            if fb.extend_seq_lens_cpu is not None:
                max_len = max(fb.extend_seq_lens_cpu, default=0)
            else:
                max_len = fb.extend_num_tokens  # may be None: then q's rows bound it
            self.forward_metadata = TritonAttnMetadata(
                fb.req_pool_indices, fb.seq_lens, fb.extend_seq_lens, start_loc, max_len
            )
        else:
            self.forward_metadata = None  # IDLE: no tokens

    # ------------------------------------------------------------------ forward
    @staticmethod
    def _output(
        out: Optional[torch.Tensor], rows: int, num_heads: int, head_dim: int, q: torch.Tensor
    ) -> torch.Tensor:
        if out is None:
            return torch.empty((rows, num_heads, head_dim), dtype=q.dtype, device=q.device)
        if out.shape[0] != rows or out.numel() != rows * num_heads * head_dim or out.dtype != q.dtype:
            raise ValueError(f"attention output buffer {tuple(out.shape)} {out.dtype} does not fit q {tuple(q.shape)}")
        return out.view(rows, num_heads, head_dim)

    def _shapes(self, layer: "RadixAttention") -> tuple[int, int, int]:
        if layer.qk_head_dim != layer.v_head_dim:
            raise ValueError("the triton backend needs equal q/k and v head dims")
        return layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: "RadixAttention",
        forward_batch: ForwardBatch,
        out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        num_heads, num_kv_heads, head_dim = self._shapes(layer)
        num_tokens = q.shape[0]
        o = self._output(out, num_tokens, num_heads, head_dim, q)
        meta = self.forward_metadata
        if num_tokens == 0 or meta is None:
            return o.view(num_tokens, num_heads * head_dim)
        k_buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_buffer = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        k_ext = v_ext = None
        if (
            self.extend_kv_from_input
            and k is not None
            and v is not None
            and k.dtype == k_buffer.dtype
            and v.dtype == v_buffer.dtype
            and k.shape[0] == num_tokens
            and v.shape[0] == num_tokens
        ):
            k_ext = k.reshape(num_tokens, num_kv_heads, head_dim)
            v_ext = v.reshape(num_tokens, num_kv_heads, head_dim)
        max_len = meta.max_extend_len if meta.max_extend_len is not None else num_tokens
        extend_attention_fwd(
            q.reshape(num_tokens, num_heads, head_dim),
            o,
            k_buffer,
            v_buffer,
            self.req_to_token_pool.req_to_token,
            meta.req_pool_indices,
            meta.seq_lens,
            meta.extend_seq_lens,
            meta.extend_start_loc,
            max_extend_len=min(max_len, num_tokens),
            sm_scale=layer.scaling,
            k_extend=k_ext,
            v_extend=v_ext,
        )
        return o.view(num_tokens, num_heads * head_dim)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: "RadixAttention",
        forward_batch: ForwardBatch,
        out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        num_heads, _, head_dim = self._shapes(layer)
        rows = q.shape[0]
        o = self._output(out, rows, num_heads, head_dim, q)
        meta = self.forward_metadata
        if rows == 0 or meta is None:
            return o.view(rows, num_heads * head_dim)
        # Inside a breakable decode replay q has the bucket's rows but the metadata only the live
        # requests': compute those, leave the padding rows alone (their outputs are dropped).
        bs = min(rows, meta.seq_lens.numel())
        scratch = self._decode_scratch(meta, bs, num_heads, head_dim, q.device)
        decode_attention_fwd(
            q[:bs].reshape(bs, num_heads, head_dim),
            o[:bs],
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id),
            self.req_to_token_pool.req_to_token,
            meta.req_pool_indices,
            meta.seq_lens,
            sm_scale=layer.scaling,
            num_kv_splits=self.num_kv_splits,
            part_o=scratch[0],
            part_lse=scratch[1],
        )
        return o.view(rows, num_heads * head_dim)

    def _decode_scratch(
        self, meta: TritonAttnMetadata, bs: int, num_heads: int, head_dim: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        def allocate() -> tuple[torch.Tensor, torch.Tensor]:
            return (
                torch.empty((bs, num_heads, self.num_kv_splits, head_dim), dtype=torch.float32, device=device),
                torch.empty((bs, num_heads, self.num_kv_splits), dtype=torch.float32, device=device),
            )

        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # A captured kernel must own its scratch: a fresh tensor from the graph's pool (free
            # under capture). One cached on the metadata would be freed when the metadata is
            # replaced, while the graph still writes to it.
            return allocate()
        scratch = meta.decode_scratch
        if scratch is None or scratch[0].shape[0] < bs or scratch[0].shape[1:] != (
            num_heads, self.num_kv_splits, head_dim
        ):
            scratch = meta.decode_scratch = allocate()
        return scratch

    # ------------------------------------------------------------------ CUDA graph hooks
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        # Called by the decode and the prefill runner alike: size for every request row the pool
        # has (no live batch can exceed it) so a second call never has to move a buffer.
        capacity = max(max_bs, self.req_to_token_pool.size)
        if self._decode_bufs is not None and self._decode_bufs.capacity >= capacity:
            return
        if self._captured:
            raise ValueError(
                f"init_cuda_graph_state(max_bs={max_bs}) after a capture would move static "
                f"buffers sized {self._decode_bufs.capacity}"
            )
        self._decode_bufs = _StaticBuffers.allocate(capacity, self.device)
        self._decode_bufs.req_pool_indices.fill_(self.padding_req_row)
        self._decode_bufs.seq_lens.fill_(self.get_cuda_graph_seq_len_fill_value())
        self._extend_bufs = _StaticBuffers.allocate(capacity, self.device)  # zeros: empty slots

    def _require_bufs(self, bs: int) -> None:
        if self._decode_bufs is None:
            raise RuntimeError("init_cuda_graph_state must run before capturing a graph")
        if bs > self._decode_bufs.capacity:
            raise ValueError(
                f"batch of {bs} requests exceeds the graph buffers ({self._decode_bufs.capacity})"
            )

    def init_forward_metadata_capture_cuda_graph(
        self,
        bs: int,
        num_tokens: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        forward_mode: ForwardMode,
        forward_batch: ForwardBatch,
    ) -> None:
        self._require_bufs(bs)
        self._captured = True
        if forward_mode.is_extend():
            self._extend_slots = bs if self._extend_slots is None else min(self._extend_slots, bs)
            self._fill_extend(self._extend_bufs, req_pool_indices, seq_lens, forward_batch)
            self.forward_metadata = self._extend_metadata(bs)
        else:
            self._fill_decode(self._decode_bufs, req_pool_indices, seq_lens)
            self.forward_metadata = TritonAttnMetadata(
                self._decode_bufs.req_pool_indices[:bs], self._decode_bufs.seq_lens[:bs]
            )

    def init_forward_metadata_replay_cuda_graph(
        self,
        bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: Optional[torch.Tensor],
        forward_mode: ForwardMode,
        forward_batch: ForwardBatch,
    ) -> None:
        # Whether the caller passes the live rows only or rows already padded to the bucket, the
        # whole tail past them is reset, so any captured bucket reads consistent values.
        n = int(req_pool_indices.numel())
        self._require_bufs(max(bs, n))
        if forward_mode.is_extend():
            if self._extend_slots is None:
                raise RuntimeError("no full prefill graph was captured")
            if n > self._extend_slots:
                raise ValueError(
                    f"{n} requests do not fit the full prefill graph's {self._extend_slots} "
                    "request slots; run this batch eagerly"
                )
            self._fill_extend(self._extend_bufs, req_pool_indices, seq_lens, forward_batch)
            self.forward_metadata = self._extend_metadata(self._extend_slots)
        else:
            self._fill_decode(self._decode_bufs, req_pool_indices, seq_lens)
            rows = max(bs, n)
            self.forward_metadata = TritonAttnMetadata(
                self._decode_bufs.req_pool_indices[:rows], self._decode_bufs.seq_lens[:rows]
            )

    # ------------------------------------------------------------------ static buffer fills
    def _fill_decode(
        self, bufs: _StaticBuffers, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor
    ) -> None:
        n = bufs.load_requests(req_pool_indices, seq_lens)
        # Padded rows: a valid request row, and a short fill length keeps them cheap.
        if bufs.live_rows > n:
            bufs.req_pool_indices[n : bufs.live_rows].fill_(self.padding_req_row)
            bufs.seq_lens[n : bufs.live_rows].fill_(self.get_cuda_graph_seq_len_fill_value())
        bufs.live_rows = n

    def _fill_extend(
        self,
        bufs: _StaticBuffers,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        forward_batch: ForwardBatch,
    ) -> None:
        if forward_batch.extend_seq_lens is None:
            raise ValueError("an EXTEND graph batch needs extend_seq_lens")
        n = int(req_pool_indices.numel())
        ext = forward_batch.extend_seq_lens
        start = forward_batch.extend_start_loc
        if start is None:
            start = _exclusive_cumsum(ext)
        bufs.load_requests(req_pool_indices, seq_lens)
        bufs.extend_seq_lens[:n].copy_(ext[:n], non_blocking=True)
        bufs.extend_start_loc[:n].copy_(start[:n], non_blocking=True)
        # Zero-length sentinels: extend_len 0 makes every program of the slot return at once.
        if bufs.live_rows > n:
            bufs.rows[:, n : bufs.live_rows].zero_()
        bufs.live_rows = n

    def _extend_metadata(self, slots: int) -> TritonAttnMetadata:
        b = self._extend_bufs
        return TritonAttnMetadata(
            b.req_pool_indices[:slots],
            b.seq_lens[:slots],
            b.extend_seq_lens[:slots],
            b.extend_start_loc[:slots],
            max_extend_len=None,
        )


__all__ = ["TritonAttnBackend", "TritonAttnMetadata"]
