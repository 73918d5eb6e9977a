"""Sort-free top-k / top-p: the per-row probability threshold t such that the kept set is {i : p_i >= t}.

A row's kept set under top-k (the k most likely) and top-p (the smallest most-likely prefix whose
mass reaches top_p) is a set of the largest values, so one threshold describes it. With
C(x) = #{p_i >= x} and S(x) = sum{p_i : p_i >= x}, the threshold of the intersection is the
largest x with

    (top-k on and C(x) >= k)  or  (top-p on and S(x) > top_p)

(x <= the k-th largest value exactly when C(x) >= k; a value v is top-p's last kept one exactly
when the mass strictly above it is <= top_p while S(v) > top_p). The predicate is monotone in x,
and non-negative float32 values order like their int32 bit patterns, so the search runs on the
bits and ends on an exact value of the row. Each pass over the row tests N_CAND candidate bit
patterns at once (an [BLOCK, N_CAND] compare), which cuts the interval ~N_CAND + 1-fold (about
20 passes for the 31 bits at N_CAND 2, 14 at 4, instead of 31 for plain bisection). A row whose
filters are off (top_k <= 0 or >= vocab, top_p >= 1) gets t = 0: everything is kept.

One program per row; a 152k-token row (600 KB of float32) stays in the H100's L2 across its
passes. No host synchronisation and no data-dependent host branch: it can sit in a CUDA graph.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

# Launch defaults, from H100 sweeps at 64 x 151936, top_p 0.9 (full-row sort: 1340 µs): the
# search looks bound by one program's loads in flight more than by arithmetic: big tiles, few
# candidates win. (BLOCK, N_CAND, warps) -> µs: (1024, 8, 8) 981, (2048, 4, 8) 734, (4096, 4, 16)
# 546, (8192, 2, 16) 477, (16384, 1, 16) 437; 32 warps lose (16384, 1: 503); (8192, 4, 16) 4432,
# (4096, 8, 16) 6676, (16384, 2, 32) 1511 and (32768, 1, 32) 1305 fall off a register cliff. Chunks
# of rows as programs of their own (a launch per pass, so all SMs work) measured 383 µs under a
# CUDA graph but 500-640 eagerly, where the Sampler runs: its 11 launches cost more than they save.
BLOCK = 16384
N_CAND = 1
NUM_WARPS = 16

# +inf as int32 bits: no probability reaches it, so the predicate is false there. A constexpr: the
# compiler refuses plain globals inside a kernel (the interpreter would not notice).
_INF_BITS: tl.constexpr = tl.constexpr(0x7F800000)


@triton.jit
def _topk_topp_threshold_kernel(
    P, TOP_K, TOP_P, T, OUT,
    stride_p, stride_o,
    n_cols,
    BLOCK: tl.constexpr,
    N_CAND: tl.constexpr,
    WRITE_OUT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = P + row * stride_p
    k = tl.load(TOP_K + row).to(tl.int64)
    top_p = tl.load(TOP_P + row).to(tl.float32)
    # An off filter gets a bound no count / mass reaches, so its half of the predicate is false.
    k_eff = tl.where((k > 0) & (k < n_cols), k, n_cols + 1).to(tl.int32)
    p_eff = tl.where(top_p < 1.0, top_p, float("inf"))

    # Invariant: the answer is in [lo, hi). lo = 0 counts as "true": t = 0 keeps every token,
    # which is also the right answer when the predicate holds nowhere (nothing is filtered).
    lo = tl.zeros([], dtype=tl.int64)
    hi = tl.full([], _INF_BITS, dtype=tl.int64)
    j = tl.arange(0, N_CAND).to(tl.int64) + 1
    offs = tl.arange(0, BLOCK)
    while hi - lo > 1:
        # N_CAND candidates spread over (lo, hi), all strictly inside it (so every pass narrows).
        cand = lo + 1 + ((hi - lo - 1) * j) // (N_CAND + 1)
        cand_f = cand.to(tl.int32).to(tl.float32, bitcast=True)
        # Per-lane accumulators, reduced once per pass (not per tile): one cross-warp reduction.
        cnt = tl.zeros([BLOCK, N_CAND], dtype=tl.int32)
        mass = tl.zeros([BLOCK, N_CAND], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            idx = start + offs
            # Padding loads -1: below every candidate (all are positive floats).
            p = tl.load(base + idx, mask=idx < n_cols, other=-1.0)
            ge = p[:, None] >= cand_f[None, :]
            cnt += ge.to(tl.int32)
            mass += tl.where(ge, p[:, None], 0.0)
        ok = (tl.sum(cnt, axis=0) >= k_eff) | (tl.sum(mass, axis=0) > p_eff)
        # Monotone predicate: every true candidate lies below every false one.
        lo = tl.maximum(lo, tl.max(tl.where(ok, cand, lo), axis=0))
        hi = tl.minimum(hi, tl.min(tl.where(ok, hi, cand), axis=0))

    t = lo.to(tl.int32).to(tl.float32, bitcast=True)
    tl.store(T + row, t)
    if WRITE_OUT:
        out = OUT + row * stride_o
        for start in range(0, n_cols, BLOCK):
            idx = start + offs
            m = idx < n_cols
            p = tl.load(base + idx, mask=m, other=0.0)
            tl.store(out + idx, tl.where(p >= t, p, 0.0), mask=m)


def topk_topp_threshold(
    probs: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    block: int = BLOCK,
    n_cand: int = N_CAND,
    num_warps: int = NUM_WARPS,
) -> torch.Tensor:
    """Per-row thresholds (float32 [B]) of top-k / top-p over float32 `probs` [B, V] (non-negative).

    `top_ks` int [B] (<= 0 or >= V: off), `top_ps` float [B] (>= 1: off). With `out` (float32
    [B, V], may be `probs`), also writes the filtered rows there: p where p >= t, else 0.
    Tokens equal to the cutoff value are all kept (ties are inclusive).
    """
    if probs.dim() != 2 or probs.dtype != torch.float32 or probs.stride(-1) != 1:
        raise ValueError("probs must be a float32 [B, V] tensor with contiguous rows")
    n_rows, n_cols = probs.shape
    if n_cand & (n_cand - 1) or block & (block - 1):
        raise ValueError("block and n_cand must be powers of two")
    thresholds = torch.empty(n_rows, dtype=torch.float32, device=probs.device)
    if out is not None and (out.shape != probs.shape or out.stride(-1) != 1 or out.dtype != torch.float32):
        raise ValueError("out must be float32 like probs, with contiguous rows")
    if n_rows == 0:
        return thresholds
    block = min(block, triton.next_power_of_2(n_cols))
    _topk_topp_threshold_kernel[(n_rows,)](
        probs, top_ks.contiguous(), top_ps.contiguous(), thresholds, out if out is not None else probs,
        probs.stride(0), out.stride(0) if out is not None else 0,
        n_cols,
        BLOCK=block,
        N_CAND=n_cand,
        WRITE_OUT=out is not None,
        num_warps=num_warps,
    )
    return thresholds


__all__ = ["topk_topp_threshold"]
