"""A GEMV for the linear layers of a one-row batch (decode batch 1), in place of cuBLAS's GEMM.

At one row a linear layer reads its whole weight to produce one output row: bound by the weight
bytes. cuBLAS splits K for the long-K layers (o_proj, down_proj) and finishes with a reduce kernel
(one launch more each); here one program per BLOCK_N output features streams its rows of W over
the whole K, the row padded to 16 for `tl.dot` (the padding rows load nothing). A row's sums depend
on nothing but that row and the tiles, so a graph replay equals an eager pass bit for bit.

`SGLANG_ONE_ROW_GEMV=1` (read at import; off by default) makes LinearBase take it for every
one-row input on a device that runs the Triton kernels (dispatch.use_triton). It sums in another order than cuBLAS, in graphs and eager alike.
bench_gemv.py (H100, 2026-12-07, µs a call at one row, weights past L2; this kernel's best
configuration against cuBLAS): Qwen3-4B qkv_proj 16.4 / 17.0, o_proj 13.5 / 14.5, gate_up_proj
43.1 / 42.9, down_proj 26.0 / 25.8; Llama-3.1-8B 23.8 / 24.6, 17.5 / 19.3, 84.3 / 85.5, 47.6 / 49.0.
In a whole one-request Qwen3-4B step (profile_forward, variant none-gemv, the same H100 day) it
took the 72 split-K reduce kernels away but added 47 µs of GPU time (3.673 -> 3.720 ms): its 144
GEMVs took 2,909 µs where cuBLAS's GEMMs inside the step took 2,749 plus the reduces. Hence off.

The LoRA-folded GEMMs' one-row kernels (lora/triton_ops/fold_gemv.py) share `dot_k` and
`gemv_config`.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from sglang.srt.layers.triton_ops.common import dot_precision
from sglang.srt.layers.triton_ops.dispatch import use_triton

ONE_ROW_GEMV = os.environ.get("SGLANG_ONE_ROW_GEMV", "0") == "1"


def gemv_config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages) for a one-row product with W [n, k]: the fastest of
    bench_gemv.py's 16 configurations at the Qwen3-4B and Llama-3.1-8B shapes on an H100.
    - Long K over a narrow N (o_proj, down_proj: k >= 4,096, n <= 4,096), five stages: 32 rows a
      program where N is under 4,096 (Qwen3-4B's 2,560: 80 programs rather than 40), with 512
      columns a tile over its down_proj's K of 9,728; (64, 256) on the 8B's N of 4,096.
    - The wide, short-K gate_up_proj of Qwen3-4B (N 19,456, K 2,560): (32, 512).
    - The rest (qkv_proj; Llama-3.1-8B's gate_up_proj): (64, 256)."""
    if k >= 4096 and n <= 4096:
        return (32, 512 if k > 8192 else 256, 4, 5) if n < 4096 else (64, 256, 4, 5)
    if n >= 16384 and k <= 3072:
        return 32, 512, 4, 3
    return 64, 256, 4, 3


@triton.jit
def dot_k(x_ptr, w_rows, acc, read, K, offs_b, b_mask, PRECISION: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc += x[:, :K] @ W[read rows, :K]^T over BLOCK_K tiles: x one row at x_ptr (padded to
    acc's rows by b_mask), w_rows the pointers to the program's rows of W [1, BLOCK_N]; rows not
    read load zeros and fetch nothing."""
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        x = tl.load(x_ptr + k0 + offs_k[None, :] + offs_b[:, None] * 0, mask=b_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w = tl.load(w_rows + k0 + offs_k[:, None], mask=k_mask[:, None] & read[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, N, K, stride_w, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_b = tl.arange(0, 16)  # tl.dot needs 16 rows: the live row is row 0
    b_mask = offs_b < 1
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    acc = dot_k(x_ptr, w_ptr + offs_n.to(tl.int64)[None, :] * stride_w, acc, n_mask, K, offs_b, b_mask, PRECISION,
                BLOCK_K)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_b[:, None] * 0 + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=b_mask[:, None] & n_mask[None, :])


def gemv(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`F.linear(x, w, bias)` for one row x [1, K], W [N, K] with unit column strides."""
    assert x.dim() == 2 and x.shape[0] == 1 and x.stride(1) == 1 and w.stride(1) == 1, (x.shape, w.stride())
    n, k = w.shape
    assert x.shape[1] == k, (x.shape, w.shape)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = gemv_config(n, k)
    _gemv_kernel[(triton.cdiv(n, block_n),)](x, w, bias if bias is not None else y, y, n, k, w.stride(0),
                                             HAS_BIAS=bias is not None, PRECISION=dot_precision(x),
                                             BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return y


def linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`F.linear(x, w, bias)`; with SGLANG_ONE_ROW_GEMV a one-row x takes `gemv` where the Triton
    kernels run. Decided by the row count, so a graph and an eager pass of a batch compute alike."""
    if ONE_ROW_GEMV and x.dim() == 2 and x.shape[0] == 1 and x.stride(1) == 1 and w.stride(1) == 1 and use_triton(x):
        return gemv(x, w, bias)
    return F.linear(x, w, bias)
