"""Split-KV ("flash-decoding") decode attention over a paged KV pool.

Stage 1, grid `(bs, KVH, NUM_KV_SPLITS)`: one program takes one request, one KV head with *all* the
query heads that share it (GQA: K/V are loaded once for the group), and one slice of the request's
context; it writes the slice's normalised partial output and its log-sum-exp (base 2).
Stage 2, grid `(bs, H)`: merges the non-empty slices of each head.

`NUM_KV_SPLITS` is a launch constant fixed when the backend is built. The slice bounds are computed
on the device from `seq_lens[b]`: `split_len = round_up(cdiv(seq_len, NUM_KV_SPLITS), BLOCK_N)`, so
short contexts occupy only the first slices and the rest return at once. Both stages derive the same
bounds, so stage 2 never reads a slice stage 1 left unwritten, and a replayed graph needs no host
values. A request with seq_len 0 yields zeros, never NaN.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from sglang.srt.layers.attention.triton_ops.extend_attention import (
    _LOG2E,
    _NEG,
    _interpreting,
    _mma,
    dot_flags,
)
from sglang.srt.layers.triton_ops.common import release_dependents, release_enabled

# Rows of the (query-heads x keys) dot: tensor-core MMAs need at least 16.
_MIN_BLOCK_H = 16


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int
    num_warps: int
    num_stages: int


def decode_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> DecodeConfig:
    if _interpreting(device):
        return DecodeConfig(16, 4, 1)
    if dtype == torch.float32 or triton.next_power_of_2(head_dim) > 128:
        return DecodeConfig(32, 4, 2)
    # Memory bound: 128 keys per step keeps enough bytes in flight per program. Measured on an
    # H200 (benchmark/bench_attention.py --sweep, 2026-11): best or within noise of the best of
    # BLOCK_N 32/64/128 x stages 2/3 at bs 1/32, contexts 1k/8k, D 64 and 128.
    return DecodeConfig(128, 4, 2)


def default_num_kv_splits(device: torch.device, num_kv_heads: int = 8) -> int:
    """Context slices per request, fixed for the backend's life (a launch constant of graphs).

    Enough programs at bs=1 to occupy the GPU (KVH x splits >= 128 on the 132-SM H200), capped
    at 32: more slices only add partial-output traffic once the batch fills the GPU.
    """
    if _interpreting(device):
        return 4
    return max(8, min(32, triton.next_power_of_2(triton.cdiv(128, max(num_kv_heads, 1)))))


@triton.jit
def _split_bounds(seq_len, split, NUM_KV_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_KV_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    return start, end, split_len


@triton.jit
def _decode_stage1_kernel(
    Q, K_buf, V_buf, Part_O, Part_LSE,
    req_to_token, req_pool_indices, seq_lens,
    sm_scale_log2e,
    stride_qb, stride_qh,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh,
    stride_pob, stride_poh, stride_pos,
    stride_lb, stride_lh,
    stride_r2t,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + b).to(tl.int32)
    start, end, _ = _split_bounds(seq_len, split, NUM_KV_SPLITS, BLOCK_N)
    if start >= end:
        return  # empty slice: stage 2 skips it by the same bounds
    row = tl.load(req_pool_indices + b).to(tl.int64)
    r2t_row = req_to_token + row * stride_r2t

    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_h
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        # Masked positions load zeros, never slot 0's contents: padding writes whatever its rows
        # hold there (NaN included), and a zero probability times a NaN value is still NaN.
        slot = tl.load(r2t_row + pos, mask=n_mask, other=0).to(tl.int64)
        kT = tl.load(K_buf + slot[None, :] * stride_kbs + kv_head * stride_kbh + offs_d[:, None],
                     mask=n_mask[None, :] & d_mask[:, None], other=0.0)
        qk = _mma(q, kT, DOT_PRECISION, UPCAST) * sm_scale_log2e
        qk = tl.where(n_mask[None, :], qk, _NEG)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V_buf + slot[:, None] * stride_vbs + kv_head * stride_vbh + offs_d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        acc = acc * alpha[:, None] + _mma(p.to(v.dtype), v, DOT_PRECISION, UPCAST)
        m_i = m_new

    # Every slice holds >= 1 real key, so l_i > 0 for the real heads.
    po = Part_O + b.to(tl.int64) * stride_pob + heads[:, None] * stride_poh + split * stride_pos
    tl.store(po + offs_d[None, :], acc / l_i[:, None], mask=h_mask[:, None] & d_mask[None, :])
    tl.store(Part_LSE + b.to(tl.int64) * stride_lb + heads * stride_lh + split,
             m_i + tl.log2(l_i), mask=h_mask)


@triton.jit
def _decode_stage2_kernel(
    Part_O, Part_LSE, seq_lens, O,
    stride_pob, stride_poh, stride_pos,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr,
    RELEASE: tl.constexpr,
):
    # A LoRA shrink launched as a programmatic dependent (o_proj's) reads its adapter's weights
    # while this runs; it waits for this grid before it reads the output.
    release_dependents(RELEASE)
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens + b).to(tl.int32)
    offs_s = tl.arange(0, NUM_KV_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    _, _, split_len = _split_bounds(seq_len, 0, NUM_KV_SPLITS, BLOCK_N)
    s_mask = offs_s * split_len < seq_len  # the slices stage 1 wrote
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(Part_LSE + b.to(tl.int64) * stride_lb + h * stride_lh + offs_s,
                  mask=s_mask, other=_NEG)
    m = tl.max(lse, 0)
    w = tl.where(s_mask, tl.exp2(lse - m), 0.0)
    l_sum = tl.sum(w, 0)
    part = tl.load(Part_O + b.to(tl.int64) * stride_pob + h * stride_poh
                   + offs_s[:, None] * stride_pos + offs_d[None, :],
                   mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(w[:, None] * part, 0)
    out = tl.where(l_sum > 0, out / tl.maximum(l_sum, 1e-30), 0.0)  # seq_len 0 -> zeros
    tl.store(O + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d,
             out.to(O.dtype.element_ty), mask=d_mask)


def decode_attention_fwd(
    q: torch.Tensor,
    o: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    num_kv_splits: int,
    part_o: Optional[torch.Tensor] = None,
    part_lse: Optional[torch.Tensor] = None,
    config: Optional[DecodeConfig] = None,
) -> None:
    """Decode attention for `bs = q.shape[0]` requests, one query token each, written into `o`.

    q, o: [bs, H, D]; k_buffer, v_buffer: [num_slots, KVH, D]; req_pool_indices, seq_lens: at least
    bs entries. part_o [>=bs, H, num_kv_splits, D] and part_lse [>=bs, H, num_kv_splits] (float32)
    are scratch; allocated here when not given.
    """
    bs, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})")
    if k_buffer.shape[2] != head_dim or o.shape != q.shape:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, o {tuple(o.shape)}, "
                         f"k_buffer {tuple(k_buffer.shape)}")
    if num_kv_splits < 1 or num_kv_splits & (num_kv_splits - 1):
        raise ValueError(f"num_kv_splits must be a power of two, got {num_kv_splits}")
    if bs == 0:
        return
    if q.dtype != k_buffer.dtype:
        q = q.to(k_buffer.dtype)
    if part_o is None:
        part_o = torch.empty((bs, num_heads, num_kv_splits, head_dim), dtype=torch.float32,
                             device=q.device)
    if part_lse is None:
        part_lse = torch.empty((bs, num_heads, num_kv_splits), dtype=torch.float32, device=q.device)
    assert part_o.stride(-1) == 1 and part_lse.stride(-1) == 1
    cfg = config or decode_config(head_dim, q.dtype, q.device)
    group = num_heads // num_kv_heads
    precision, upcast = dot_flags(q.dtype, q.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    _decode_stage1_kernel[(bs, num_kv_heads, num_kv_splits)](
        q, k_buffer, v_buffer, part_o, part_lse,
        req_to_token, req_pool_indices, seq_lens,
        sm_scale * _LOG2E,
        q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        req_to_token.stride(0),
        GROUP=group,
        BLOCK_H=max(_MIN_BLOCK_H, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=cfg.block_n,
        NUM_KV_SPLITS=num_kv_splits,
        DOT_PRECISION=precision,
        UPCAST=upcast,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    _decode_stage2_kernel[(bs, num_heads)](
        part_o, part_lse, seq_lens, o,
        part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        o.stride(0), o.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=cfg.block_n,
        NUM_KV_SPLITS=num_kv_splits,
        RELEASE=release_enabled(q.device),
        num_warps=4 if block_d >= 128 else 2,
        num_stages=1,
    )


__all__ = ["DecodeConfig", "decode_config", "default_num_kv_splits", "decode_attention_fwd"]
