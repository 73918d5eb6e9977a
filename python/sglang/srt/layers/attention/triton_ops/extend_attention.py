"""Extend (prefill) attention over a paged KV pool, with a cached prefix and a causal mask.

For request b the new tokens are rows `[extend_start_loc[b], extend_start_loc[b] + extend_seq_lens[b])`
of q; all its keys/values (cached prefix + new tokens) sit in the pool at the slots
`req_to_token[req_pool_indices[b], 0:seq_lens[b]]`. New token j (0-based within the extend) attends to
positions `< prefix_len + j + 1` with `prefix_len = seq_lens[b] - extend_seq_lens[b]`.

Graph-friendliness: the grid is `(num_requests, H, cdiv(max_extend_len, BLOCK_M))` and every program
reads its request's lengths from device tensors, returning at once when its tile holds no new token.
A captured launch therefore serves any batch whose requests fit the frozen request axis and whose
extend lengths fit the frozen token axis; zero-length requests (seq_len 0, extend_len 0) are no-ops.

One program = one (request, query head, BLOCK_M new tokens) tile. It walks the prefix through
`req_to_token` (no mask but on the last, partial block), then the new tokens (read straight from the
contiguous k/v of this pass when allowed, else through the pool), applying the causal mask only on
the diagonal blocks. Softmax is online, in fp32, in base 2 (`sm_scale * log2(e)` folded in).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from sglang.srt.layers.triton_ops.common import interpreting

# Finite "minus infinity": a fully masked tile then yields exp2(0) = 1 garbage that the next real
# tile wipes out (alpha = exp2(-1e30 - m) = 0) instead of the NaN that (-inf) - (-inf) would give.
_NEG = tl.constexpr(-1.0e30)
_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class ExtendConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def _interpreting(device: torch.device) -> bool:
    """Kernels on the CPU (Triton's interpreter), where the GPU's tile choices do not apply."""
    return device.type != "cuda" or interpreting()


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def extend_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> ExtendConfig:
    """Tile sizes per head dim and chip. A function of the layer and the device only (never of
    the batch), so a graph's replay runs exactly the kernel its capture recorded."""
    if _interpreting(device):
        # Small tiles so tests at tiny shapes still cross block boundaries.
        return ExtendConfig(16, 16, 4, 1)
    block_d = triton.next_power_of_2(head_dim)
    if dtype == torch.float32:
        # fp32 tiles take twice the registers/shared memory of bf16 ones.
        return ExtendConfig(64, 32, 4, 2) if block_d <= 128 else ExtendConfig(32, 32, 4, 1)
    major, _ = _capability(device.index if device.index is not None else torch.cuda.current_device())
    if block_d <= 128:
        # H200, bf16, causal (benchmark/bench_attention.py --sweep, 2026-11): 64x64 tiles, 4
        # warps, 3 stages were fastest at 128 and 2048 new tokens for D=64 and D=128 (more
        # programs, shorter causal tail per program). Wider key blocks (128x128 at D=128, 64x128
        # at D=64) win only when a long cached prefix dominates (512 over 4096: 12% / 28%).
        return ExtendConfig(64, 64, 4, 3 if major >= 9 else 2)
    return ExtendConfig(32, 32, 4, 2)


@triton.jit
def _mma(a, b, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # UPCAST: the interpreter multiplies bf16 dot operands as raw bits (triton-lang/triton#11584),
    # so on CPU bf16 tiles go through an fp32 dot. Never set on the GPU.
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _softmax_step(q, kT, v, mask, m_i, l_i, acc, sm_scale_log2e,
                  APPLY_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    qk = _mma(q, kT, DOT_PRECISION, UPCAST) * sm_scale_log2e
    if APPLY_MASK:
        qk = tl.where(mask, qk, _NEG)
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _mma(p.to(v.dtype), v, DOT_PRECISION, UPCAST)
    return m_new, l_i, acc


@triton.jit
def _load_kv_from_pool(r2t_row, pos, pos_mask, K_buf, V_buf, kv_head, offs_d, d_mask,
                       stride_kbs, stride_kbh, stride_vbs, stride_vbh):
    slot = tl.load(r2t_row + pos, mask=pos_mask, other=0).to(tl.int64)
    # Masked positions load zeros, never slot 0's contents: padding writes whatever its rows hold
    # there (NaN included), and a zero probability times a NaN value is still NaN.
    kT = tl.load(K_buf + slot[None, :] * stride_kbs + kv_head * stride_kbh + offs_d[:, None],
                 mask=pos_mask[None, :] & d_mask[:, None], other=0.0)
    v = tl.load(V_buf + slot[:, None] * stride_vbs + kv_head * stride_vbh + offs_d[None, :],
                mask=pos_mask[:, None] & d_mask[None, :], other=0.0)
    return kT, v


@triton.jit
def _extend_attn_kernel(
    Q, K_ext, V_ext, K_buf, V_buf, O,
    req_to_token, req_pool_indices, seq_lens, extend_seq_lens, extend_start_loc,
    sm_scale_log2e,
    stride_qt, stride_qh,
    stride_ket, stride_keh, stride_vet, stride_veh,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh,
    stride_ot, stride_oh,
    stride_r2t,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KV_FROM_INPUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    m_start = tl.program_id(2) * BLOCK_M
    ext_len = tl.load(extend_seq_lens + b).to(tl.int32)
    if m_start >= ext_len:
        return  # unused request slot, or a token tile past this request's new tokens
    prefix_len = tl.load(seq_lens + b).to(tl.int32) - ext_len
    q_start = tl.load(extend_start_loc + b).to(tl.int64)
    row = tl.load(req_pool_indices + b).to(tl.int64)
    kv_head = h // GROUP
    r2t_row = req_to_token + row * stride_r2t

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < ext_len
    d_mask = offs_d < HEAD_DIM
    q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Phase 1: the cached prefix. Every new token sees all of it: no mask but the ragged end.
    prefix_full = (prefix_len // BLOCK_N) * BLOCK_N
    for n0 in range(0, prefix_full, BLOCK_N):
        pos = n0 + offs_n
        kT, v = _load_kv_from_pool(r2t_row, pos, pos < prefix_len, K_buf, V_buf, kv_head, offs_d,
                                   d_mask, stride_kbs, stride_kbh, stride_vbs, stride_vbh)
        m_i, l_i, acc = _softmax_step(q, kT, v, None, m_i, l_i, acc, sm_scale_log2e,
                                      False, DOT_PRECISION, UPCAST)
    if prefix_full < prefix_len:
        pos = prefix_full + offs_n
        pos_mask = pos < prefix_len
        kT, v = _load_kv_from_pool(r2t_row, pos, pos_mask, K_buf, V_buf, kv_head, offs_d,
                                   d_mask, stride_kbs, stride_kbh, stride_vbs, stride_vbh)
        m_i, l_i, acc = _softmax_step(q, kT, v, pos_mask[None, :], m_i, l_i, acc,
                                      sm_scale_log2e, True, DOT_PRECISION, UPCAST)

    # Phase 2: the new tokens. Blocks wholly left of this tile's first row need no causal mask
    # (every j there is a real token below the diagonal); the blocks from there on do. Two loops,
    # not a branch in one: a dot under a runtime branch defeats Triton's software pipelining.
    full_end = (m_start // BLOCK_N) * BLOCK_N
    for j0 in range(0, full_end, BLOCK_N):
        j = j0 + offs_n
        if KV_FROM_INPUT:
            kT = tl.load(K_ext + (q_start + j)[None, :] * stride_ket + kv_head * stride_keh
                         + offs_d[:, None], mask=d_mask[:, None], other=0.0)
            v = tl.load(V_ext + (q_start + j)[:, None] * stride_vet + kv_head * stride_veh
                        + offs_d[None, :], mask=d_mask[None, :], other=0.0)
        else:
            kT, v = _load_kv_from_pool(r2t_row, prefix_len + j, j < full_end, K_buf, V_buf,
                                       kv_head, offs_d, d_mask, stride_kbs, stride_kbh,
                                       stride_vbs, stride_vbh)
        m_i, l_i, acc = _softmax_step(q, kT, v, None, m_i, l_i, acc, sm_scale_log2e,
                                      False, DOT_PRECISION, UPCAST)
    ext_end = tl.minimum(ext_len, m_start + BLOCK_M)
    for j0 in range(full_end, ext_end, BLOCK_N):
        j = j0 + offs_n
        j_mask = j < ext_end
        if KV_FROM_INPUT:
            kT = tl.load(K_ext + (q_start + j)[None, :] * stride_ket + kv_head * stride_keh
                         + offs_d[:, None], mask=j_mask[None, :] & d_mask[:, None], other=0.0)
            v = tl.load(V_ext + (q_start + j)[:, None] * stride_vet + kv_head * stride_veh
                        + offs_d[None, :], mask=j_mask[:, None] & d_mask[None, :], other=0.0)
        else:
            kT, v = _load_kv_from_pool(r2t_row, prefix_len + j, j_mask, K_buf, V_buf, kv_head,
                                       offs_d, d_mask, stride_kbs, stride_kbh, stride_vbs,
                                       stride_vbh)
        causal = (j[None, :] <= offs_m[:, None]) & j_mask[None, :]
        m_i, l_i, acc = _softmax_step(q, kT, v, causal, m_i, l_i, acc, sm_scale_log2e,
                                      True, DOT_PRECISION, UPCAST)

    out = acc / l_i[:, None]
    tl.store(O + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def dot_flags(dtype: torch.dtype, device: torch.device) -> tuple[str, bool]:
    """(input_precision, upcast) for the kernels' dots."""
    upcast = dtype == torch.bfloat16 and _interpreting(device)
    # fp32 operands must not silently drop to tf32 (the GPU default for fp32 dots).
    return ("ieee" if dtype == torch.float32 or upcast else "tf32"), upcast


def extend_attention_fwd(
    q: torch.Tensor,
    o: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    max_extend_len: int,
    sm_scale: float,
    k_extend: Optional[torch.Tensor] = None,
    v_extend: Optional[torch.Tensor] = None,
    config: Optional[ExtendConfig] = None,
) -> None:
    """Write extend attention for every live row of `q` into `o`.

    q, o: [T, H, D]; k_buffer, v_buffer: [num_slots, KVH, D]; req_to_token: int32 [rows, ctx];
    per-request tensors: [num_requests] (the grid's request axis). `max_extend_len` sizes the
    grid's token axis and must be >= every extend_seq_lens[b] (a graph capture passes its bucket).
    `k_extend`/`v_extend` ([T, KVH, D], same dtype as the pool): when given, the new tokens' K/V
    are read from them instead of through the pool (they hold the same values).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})")
    if k_buffer.shape[2] != head_dim or o.shape != q.shape:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, o {tuple(o.shape)}, "
                         f"k_buffer {tuple(k_buffer.shape)}")
    num_reqs = extend_seq_lens.shape[0]
    if num_reqs == 0 or max_extend_len <= 0:
        return
    if q.dtype != k_buffer.dtype:
        q = q.to(k_buffer.dtype)  # tl.dot needs matching operand types
    kv_from_input = k_extend is not None and v_extend is not None
    if kv_from_input:
        assert k_extend.dtype == k_buffer.dtype and k_extend.stride(-1) == 1
        assert v_extend.dtype == v_buffer.dtype and v_extend.stride(-1) == 1
    else:
        k_extend, v_extend = k_buffer, v_buffer  # placeholders; the kernel never reads them
    cfg = config or extend_config(head_dim, q.dtype, q.device)
    precision, upcast = dot_flags(q.dtype, q.device)
    grid = (num_reqs, num_heads, triton.cdiv(max_extend_len, cfg.block_m))
    _extend_attn_kernel[grid](
        q, k_extend, v_extend, k_buffer, v_buffer, o,
        req_to_token, req_pool_indices, seq_lens, extend_seq_lens, extend_start_loc,
        sm_scale * _LOG2E,
        q.stride(0), q.stride(1),
        k_extend.stride(0), k_extend.stride(1), v_extend.stride(0), v_extend.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        o.stride(0), o.stride(1),
        req_to_token.stride(0),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        KV_FROM_INPUT=kv_from_input,
        DOT_PRECISION=precision,
        UPCAST=upcast,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


__all__ = ["ExtendConfig", "extend_config", "extend_attention_fwd"]
