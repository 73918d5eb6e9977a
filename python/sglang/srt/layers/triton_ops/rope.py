"""RoPE on q and k of the fused qkv output, in place, in one kernel; optionally Qwen3's per-head
q/k RMSNorm before it and the KV-cache store after it.

The qkv projection's rows are laid out [q heads | k heads | v heads], each head `head_dim` wide, so
head h of a token starts at column h * head_dim whatever its kind. One program takes one token and
BLOCK_H consecutive heads of that axis:

    q head   (norm) -> rotate -> written back in place
    k head   (norm) -> rotate -> written back in place, and to k_buffer[loc]      (with the store)
    v head                    ->                         written to v_buffer[loc]  (with the store)

The rotation is the "rotate half" layout over the first `rotary_dim` dims (the rest pass through):
    out[i]        = x[i] * cos[i] - x[i + half] * sin[i]
    out[i + half] = x[i + half] * cos[i] + x[i] * sin[i]          (i < half = rotary_dim / 2)
with cos/sin read from the float32 cache at the token's position and rounded to the model dtype,
and every product and sum rounded to the model dtype, the order of the Hugging Face reference
(`q * cos + rotate_half(q) * sin` in the model dtype). The norm rounds like RMSNorm.

Padded tokens of a graph replay carry out_cache_loc 0 and write the dummy slot 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from sglang.srt.layers.triton_ops.common import cast_rne, interpreting


@dataclass(frozen=True)
class QKNormWeights:
    q_weight: torch.Tensor  # [head_dim]
    k_weight: torch.Tensor  # [head_dim]
    eps: float


@dataclass(frozen=True)
class KVStore:
    """Where the new tokens' K/V go: the layer's pool buffers [slots, kv_heads, head_dim] and the
    slot of each token ([T], int64; padding -> 0)."""

    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    loc: torch.Tensor


# Whether the kernel loads the token's KV-cache slot at its start rather than just before the store:
# the load otherwise follows the q/k stores (the compiler keeps it after them: they might alias), one
# more round trip to memory at the program's end. The same bits. On since the H100 timed it with
# WEIGHT_FIRST (2026-12-07: the whole base step 1.00-0.98 of the old order; profile_forward's
# `none-late-loads` variant turns both off).
LOC_FIRST = True


@triton.jit
def _round(x, DTYPE: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """float32 -> DTYPE -> float32: one rounding of the reference's model-dtype arithmetic."""
    return cast_rne(x, DTYPE, EMULATE_RNE).to(tl.float32)


@triton.jit
def _qkv_rope_kernel(
    QKV, stride_t,
    POS, COS_SIN, stride_cs,
    QW, KW, eps,
    K_BUF, V_BUF, LOC,
    stride_kb_slot, stride_kb_head, stride_vb_slot, stride_vb_head,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    SIN_OFFSET: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PASS: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    QK_NORM: tl.constexpr,
    STORE_KV: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
    LOC_FIRST: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    if STORE_KV and LOC_FIRST:
        loc = tl.load(LOC + t).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    is_k = (heads >= NUM_Q_HEADS) & (heads < NUM_Q_HEADS + NUM_KV_HEADS)
    is_rot = heads < NUM_Q_HEADS + NUM_KV_HEADS  # q and k heads
    is_v = (heads >= NUM_Q_HEADS + NUM_KV_HEADS) & (heads < NUM_Q_HEADS + 2 * NUM_KV_HEADS)
    if STORE_KV:
        live = is_rot | is_v
    else:
        live = is_rot
    rot = is_rot[:, None]

    offs_h = tl.arange(0, BLOCK_HALF)
    h_mask = offs_h < HALF
    rows = QKV + t * stride_t + heads[:, None] * HEAD_DIM
    m_half = live[:, None] & h_mask[None, :]
    x1 = tl.load(rows + offs_h[None, :], mask=m_half, other=0.0)
    dt = x1.dtype
    f1 = x1.to(tl.float32)
    f2 = tl.load(rows + HALF + offs_h[None, :], mask=m_half, other=0.0).to(tl.float32)
    offs_p = tl.arange(0, BLOCK_PASS)
    p_mask = offs_p < PASS
    m_pass = live[:, None] & p_mask[None, :]
    fp = tl.zeros([BLOCK_H, BLOCK_PASS], tl.float32)
    if PASS > 0:
        fp = tl.load(rows + 2 * HALF + offs_p[None, :], mask=m_pass, other=0.0).to(tl.float32)

    if QK_NORM:
        sq = tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)
        if PASS > 0:
            sq += tl.sum(fp * fp, axis=1)
        rstd = tl.math.rsqrt(sq / HEAD_DIM + eps)[:, None]
        kw = is_k[:, None]
        w1 = tl.where(kw, tl.load(KW + offs_h, mask=h_mask, other=0.0)[None, :],
                      tl.load(QW + offs_h, mask=h_mask, other=0.0)[None, :]).to(tl.float32)
        w2 = tl.where(kw, tl.load(KW + HALF + offs_h, mask=h_mask, other=0.0)[None, :],
                      tl.load(QW + HALF + offs_h, mask=h_mask, other=0.0)[None, :]).to(tl.float32)
        # v heads (loaded only for the store) are not normalised.
        f1 = tl.where(rot, _round(_round(f1 * rstd, dt, EMULATE_RNE) * w1, dt, EMULATE_RNE), f1)
        f2 = tl.where(rot, _round(_round(f2 * rstd, dt, EMULATE_RNE) * w2, dt, EMULATE_RNE), f2)
        if PASS > 0:
            wp = tl.where(kw, tl.load(KW + 2 * HALF + offs_p, mask=p_mask, other=0.0)[None, :],
                          tl.load(QW + 2 * HALF + offs_p, mask=p_mask, other=0.0)[None, :]).to(tl.float32)
            fp = tl.where(rot, _round(_round(fp * rstd, dt, EMULATE_RNE) * wp, dt, EMULATE_RNE), fp)
            tl.store(rows + 2 * HALF + offs_p[None, :], fp.to(dt), mask=m_pass & rot)

    pos = tl.load(POS + t).to(tl.int64)
    cs_row = COS_SIN + pos * stride_cs
    cos = _round(tl.load(cs_row + offs_h, mask=h_mask, other=0.0), dt, EMULATE_RNE)[None, :]
    sin = _round(tl.load(cs_row + SIN_OFFSET + offs_h, mask=h_mask, other=0.0), dt, EMULATE_RNE)[None, :]
    a = _round(f1 * cos, dt, EMULATE_RNE) - _round(f2 * sin, dt, EMULATE_RNE)
    b = _round(f2 * cos, dt, EMULATE_RNE) + _round(f1 * sin, dt, EMULATE_RNE)
    o1 = tl.where(rot, _round(a, dt, EMULATE_RNE), f1)
    o2 = tl.where(rot, _round(b, dt, EMULATE_RNE), f2)
    m_rot = rot & h_mask[None, :]
    tl.store(rows + offs_h[None, :], o1.to(dt), mask=m_rot)
    tl.store(rows + HALF + offs_h[None, :], o2.to(dt), mask=m_rot)

    if STORE_KV:
        if not LOC_FIRST:
            loc = tl.load(LOC + t).to(tl.int64)
        kv_head = tl.where(is_k, heads - NUM_Q_HEADS, heads - NUM_Q_HEADS - NUM_KV_HEADS)
        kv_head = tl.where(is_k | is_v, kv_head, 0)[:, None]
        k_rows = K_BUF + loc * stride_kb_slot + kv_head * stride_kb_head
        v_rows = V_BUF + loc * stride_vb_slot + kv_head * stride_vb_head
        mk = is_k[:, None] & h_mask[None, :]
        mv = is_v[:, None] & h_mask[None, :]
        kt = K_BUF.dtype.element_ty
        vt = V_BUF.dtype.element_ty
        tl.store(k_rows + offs_h[None, :], o1.to(kt), mask=mk)
        tl.store(k_rows + HALF + offs_h[None, :], o2.to(kt), mask=mk)
        tl.store(v_rows + offs_h[None, :], o1.to(vt), mask=mv)
        tl.store(v_rows + HALF + offs_h[None, :], o2.to(vt), mask=mv)
        if PASS > 0:
            tl.store(k_rows + 2 * HALF + offs_p[None, :], fp.to(kt), mask=is_k[:, None] & p_mask[None, :])
            tl.store(v_rows + 2 * HALF + offs_p[None, :], fp.to(vt), mask=is_v[:, None] & p_mask[None, :])


def qkv_rope_fwd(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    qk_norm: Optional[QKNormWeights] = None,
    kv_store: Optional[KVStore] = None,
) -> None:
    """Rotate (and normalise) q and k of `qkv` [T, (Hq + 2 Hkv) * head_dim] in place; with
    `kv_store`, also write k (rotated) and v into the pool at `kv_store.loc`.

    `cos_sin_cache` [max_position, 2 * rotary_dim] float32 holds [cos | cos | -sin | sin] per
    position (RotaryEmbedding's buffer): the kernel reads the first cos and the positive sin.
    """
    num_tokens = qkv.shape[0]
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be [T, {width}] with contiguous rows, got {tuple(qkv.shape)}")
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"invalid rotary_dim {rotary_dim} for head_dim {head_dim}")
    if cos_sin_cache.shape[-1] != 2 * rotary_dim or cos_sin_cache.stride(-1) != 1:
        raise ValueError(f"cos_sin_cache must be [max_pos, {2 * rotary_dim}], got {tuple(cos_sin_cache.shape)}")
    if num_tokens == 0:
        return
    half = rotary_dim // 2
    pass_dims = head_dim - rotary_dim
    heads = num_q_heads + num_kv_heads + (num_kv_heads if kv_store is not None else 0)
    block_half = triton.next_power_of_2(half)
    # ~512 elements per program: enough work per program at long prefills, enough programs for a
    # single decode token. Depends on the layer only (never on T), like every launch constant here.
    block_h = max(1, min(triton.next_power_of_2(heads), 256 // block_half))
    if kv_store is not None:
        kb, vb, loc = kv_store.k_buffer, kv_store.v_buffer, kv_store.loc
        for buf in (kb, vb):
            if buf.dim() != 3 or buf.shape[1] != num_kv_heads or buf.shape[2] != head_dim or buf.stride(2) != 1:
                raise ValueError(f"KV buffer must be [slots, {num_kv_heads}, {head_dim}], got {tuple(buf.shape)}")
        if loc.shape[0] != num_tokens:
            raise ValueError(f"{loc.shape[0]} cache locations for {num_tokens} tokens")
        strides = (kb.stride(0), kb.stride(1), vb.stride(0), vb.stride(1))
    else:
        kb = vb = loc = qkv  # placeholders, never read
        strides = (0, 0, 0, 0)
    if qk_norm is not None:
        qw, kw, eps = qk_norm.q_weight, qk_norm.k_weight, float(qk_norm.eps)
        if qw.shape != (head_dim,) or kw.shape != (head_dim,):
            raise ValueError(f"q/k norm weights must be [{head_dim}]")
    else:
        qw = kw = cos_sin_cache
        eps = 0.0
    _qkv_rope_kernel[(num_tokens, triton.cdiv(heads, block_h))](
        qkv, qkv.stride(0),
        positions, cos_sin_cache, cos_sin_cache.stride(0),
        qw, kw, eps,
        kb, vb, loc,
        *strides,
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HALF=half,
        SIN_OFFSET=3 * half,
        BLOCK_HALF=block_half,
        PASS=pass_dims,
        BLOCK_PASS=triton.next_power_of_2(max(pass_dims, 1)),
        BLOCK_H=block_h,
        QK_NORM=qk_norm is not None,
        STORE_KV=kv_store is not None,
        EMULATE_RNE=interpreting(),
        LOC_FIRST=LOC_FIRST,
        num_warps=4 if block_h * block_half >= 512 else 2,
    )


__all__ = ["KVStore", "QKNormWeights", "qkv_rope_fwd"]
