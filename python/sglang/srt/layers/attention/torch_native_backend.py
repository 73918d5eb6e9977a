"""The reference attention backend: PyTorch SDPA, one request at a time, K/V read from the pool.

Runs on any device and favours obviousness over speed; the Triton backend is tested against it.
It is not capturable (per-request Python loop with host-side lengths), so it keeps the base
class's graph hooks, which raise.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.configs.forward_batch_info import ForwardBatch

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention

# On CUDA, cuDNN attention builds a new plan for every new sequence length (~2 ms of host time
# per call on an H200 host, measured), and every decode step has a new length: leave it out.
# On the CPU the default choice is kept (forcing the flash kernel there is ~100x slower at tiny
# decode shapes, measured).
_CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class _Metadata:
    # Per request: KV slots of the whole sequence (prefix + new tokens), device int64 [seq_len].
    kv_indices: list[torch.Tensor]
    # Per request (host): row offset in q, number of new tokens, cached prefix length.
    q_starts: list[int]
    q_lens: list[int]
    prefix_lens: list[int]


class TorchNativeAttnBackend(AttentionBackend):
    def __init__(self, model_runner) -> None:
        self.device = model_runner.device
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.metadata: _Metadata | None = None

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        seq_lens = fb.seq_lens_cpu.tolist()  # a host tensor: no device sync
        if fb.forward_mode.is_extend():
            q_lens = list(fb.extend_seq_lens_cpu)
            prefix_lens = list(fb.extend_prefix_lens_cpu or [s - n for s, n in zip(seq_lens, q_lens)])
        else:
            q_lens = [1] * fb.batch_size
            prefix_lens = [s - 1 for s in seq_lens]
        q_starts, acc = [], 0
        for n in q_lens:
            q_starts.append(acc)
            acc += n
        # One gather of the batch's rows; slicing by host lengths afterwards needs no sync.
        rows = self.req_to_token_pool.req_to_token.index_select(0, fb.req_pool_indices)
        kv_indices = [rows[i, : seq_lens[i]].long() for i in range(fb.batch_size)]
        self.metadata = _Metadata(kv_indices, q_starts, q_lens, prefix_lens)

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "RadixAttention", forward_batch: ForwardBatch,
        out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        return self._run(q, layer, causal=True, out=out)

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "RadixAttention", forward_batch: ForwardBatch,
        out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        return self._run(q, layer, causal=False, out=out)

    def _run(
        self, q: torch.Tensor, layer: "RadixAttention", causal: bool, out: Optional[torch.Tensor]
    ) -> torch.Tensor:
        md = self.metadata
        assert md is not None, "init_forward_metadata was not called"
        num_heads, head_dim = layer.tp_q_head_num, layer.head_dim
        k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        q3 = q.unflatten(-1, (num_heads, head_dim))
        # Rows past the live tokens (padding of a graph replay) stay zero.
        if out is None:
            out = torch.zeros(q3.shape, dtype=q.dtype, device=q.device)
        else:
            out.zero_()
        o3 = out.view(q.shape[0], num_heads, head_dim)
        gqa = num_heads != layer.tp_k_head_num
        backends = sdpa_kernel(_CUDA_SDPA_BACKENDS) if q.is_cuda else contextlib.nullcontext()
        with backends:
            for i, kv_idx in enumerate(md.kv_indices):
                start, n, prefix = md.q_starts[i], md.q_lens[i], md.prefix_lens[i]
                if n == 0:
                    continue
                # Contiguous [heads, len, d] operands: strided ones send CPU SDPA down a slow path.
                qi = q3[start : start + n].transpose(0, 1).contiguous()
                ki = k_cache.index_select(0, kv_idx).transpose(0, 1).to(q.dtype).contiguous()
                vi = v_cache.index_select(0, kv_idx).transpose(0, 1).to(q.dtype).contiguous()
                mask = None
                if causal and n > 1:
                    # New token j sits at absolute position prefix + j and sees keys 0..prefix + j.
                    rows = torch.arange(n, device=q.device).unsqueeze(1) + prefix
                    mask = torch.arange(prefix + n, device=q.device).unsqueeze(0) <= rows
                oi = F.scaled_dot_product_attention(
                    qi.unsqueeze(0), ki.unsqueeze(0), vi.unsqueeze(0),
                    attn_mask=mask, scale=layer.scaling, enable_gqa=gqa,
                )
                o3[start : start + n] = oi.squeeze(0).transpose(0, 1)
        return out.view(q.shape[0], num_heads * head_dim)
