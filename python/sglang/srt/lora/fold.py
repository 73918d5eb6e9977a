"""Folding LoRA into the base GEMM: the augmented weight W_aug and the pool's views of B inside it.

For a module with base weight W [N, K], c output slices and S adapter slots of rank R (the pool's
slots but the base model's, which has rank 0 and so needs no block):

    W_aug [N, K + E],  E = S*c*R rounded up to EXTRA_COLS_ALIGN
    columns [0, K)                W (the base layer's `weight` becomes the view W_aug[:, :K])
    slot s, slice k, rank j < R   column K + s*c*R + k*R + j; in the rows of slice k it holds
                                  B_k[slot s][:, j], in the rows of every other slice zero
    columns past S*c*R            zero (alignment padding)

so `[x | packed shrink] @ W_aug.T` is the base output plus every row's own adapter delta in one
GEMM (triton_ops/shrink_pack.py writes the packed rows). Only the block-diagonal parts are ever
written after allocation (`SlicedB` exposes nothing else), so the off-diagonal blocks and the
padding stay zero; rank columns j >= r of a slot are zeroed by the pool when an adapter of smaller
rank moves in.

The cost: every forward reads E*N extra weight elements and does 2*T*N*E extra FLOPs, whatever
the number of adapters the batch uses. `should_fold` bounds the extra bytes (see its docstring for
the arithmetic); modules over the bound keep separate shrink and expand kernels.

The A-fold (`a_fold_views`; o_proj and down_proj, one output slice, with a fused norm after them;
qkv_proj at prefill, A_FOLD_PREFILL_MODULES):
the buffer behind W_aug has S*R more rows, which hold A, so that

    W_a [N + S_a*R, K] = [ W ; A of every adapter slot ]      (a view: rows of W_aug's buffer, cols < K)

and one GEMM `x @ W_a.T` gives the base output and every slot's unscaled shrink. At small decode
batches the module stops there and the fused norm after it adds each row's
`scaling * shrink[slot block] @ B^T` (lora/norm_fusion.py): no LoRA kernel of its own. Elsewhere it
runs as any folded module: shrink_pack (reading A in place, row stride K + E) and the GEMM over
W_aug. The pool also keeps B transposed [slots, R, N] for the norm kernel.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

EXTRA_COLS_ALIGN = 16  # W_aug's row stride stays 32-byte aligned (bf16) for cuBLAS
# The fold saves one dependent kernel (the expand, its launch and its read-modify-write of the
# output): ~5 µs per module at decode on an H200 (first run of bench_lora_kernels: tok+pdl's
# expand half of 5.5-9.5 µs per module). The extra weight read costs E*N*2 bytes / 4.3 TB/s; 20 MiB
# is ~4.9 µs. At long prefills the extra FLOPs (2*T*N*E) stay below the expand's read-modify-write
# (4*T*N bytes) while E < 2*PEAK/BW ~ 370, which the same bound gives for the widest module
# (gate_up of Llama-8B, N = 28672: E <= 365).
FOLD_MAX_EXTRA_BYTES = 20 * 2**20
# The modules that may take the A-fold (a_fold_views): one output slice, and a fused norm after them
# (post_attention_layernorm after o_proj, the next layer's input_layernorm after down_proj).
A_FOLD_MODULES = ("o_proj", "down_proj")
# Modules that take the A-fold's layout for prefills only (csgmv, SGLANG_LORA_AFOLD_QKV): the GEMM
# over [W; A] and the segmented expand in place of shrink_pack and the GEMM over W_aug; decode keeps
# the fused norm and W_aug. bench_stacked_afold.py (H100, 2026-12-06, 8 adapters of rank 16, µs per
# layer, B fold -> A-fold): qkv_proj prefill 128 26.2 -> 22.8 (Qwen3-4B) and 33.8 -> 30.5 (8B),
# 512 41.0 -> 40.0 and 59.9 -> 55.0; gate_up_proj gains nothing at 128 (52.7 -> 52.0, 101.4 ->
# 102.1) and loses at 512 (95.5 -> 101.7, 202.3 -> 223.1): its expand's read-modify-write of the
# wide output costs more than the shrink_pack launch it saves. So qkv_proj alone. Nor at small
# decode batches with its expand in the SiLU-and-mul (tried 2026-12-06, H100, LoRA / base of a
# decode step, B fold -> A-fold: Qwen3-4B batch 1 1.10 -> 1.16, 8 on 8 adapters 1.10 -> 1.18;
# Llama-3.1-8B 1.07 -> 1.09, 1.07 -> 1.13): gate_up's GEMM over [W; A] saved at most 1.8-3 µs a
# layer against W_aug (nothing on the 8B shape), and the expand in the activation cost 4.5-11 µs.
A_FOLD_PREFILL_MODULES = ("qkv_proj",)
# The A-fold's GEMM reads S*R rows of A (K wide) where the B fold's reads S*R columns of B (N tall):
# S*R*(K - N) more bytes per module and small decode step. bench_norm_shrink (H200, 8 adapters,
# rank 16) measured the A-fold ~1.7 µs per module cheaper net of its 0.3-2.6 MiB (Qwen3-4B /
# Llama-8B down_proj: K - N = 7,168 / 10,240); 4 MiB is ~1 µs at 4.3 TB/s. Past it (many slots or a
# high rank on a wide down_proj: 64 slots of rank 16 read 14 MiB more on the Qwen3-4B shape) the
# module keeps the B fold alone.
A_FOLD_MAX_EXTRA_BYTES = 4 * 2**20


def fold_extra_columns(num_slots: int, stack: int, max_rank: int) -> int:
    """E: the extra columns of W_aug / x_aug for this module."""
    e = num_slots * stack * max_rank
    return -(-e // EXTRA_COLS_ALIGN) * EXTRA_COLS_ALIGN


def should_fold(out_dim: int, extra_cols: int, elem_size: int) -> bool:
    """The `auto` rule: fold while the extra weight bytes every forward reads stay small."""
    return out_dim * extra_cols * elem_size <= FOLD_MAX_EXTRA_BYTES


def should_a_fold(in_dim: int, out_dim: int, num_slots: int, max_rank: int, elem_size: int) -> bool:
    """Whether a folded one-slice module also takes the A-fold: its GEMM's extra bytes over the B
    fold's (A_FOLD_MAX_EXTRA_BYTES) stay small."""
    return num_slots * max_rank * max(in_dim - out_dim, 0) * elem_size <= A_FOLD_MAX_EXTRA_BYTES


Index = Union[int, slice, tuple]


class SlicedB:
    """The pool's B of one folded module and layer, [S, out, R], or of one slot, [out, R].

    It reads and writes W_aug in place through one strided view per output slice (the slices
    live in different column blocks, so no single tensor view can hold them). It offers what
    the pool's loading path does with a plain B buffer: `B[slot]`, `B[slot][:, cols]`,
    `.copy_(src)`, `.zero_()`, `.shape`, plus `.dense()` (a plain copy, for tests and the
    reference backend) and `.data_ptr()` (the pool's fixed-address check).
    """

    def __init__(self, parts: Sequence[tuple[int, int, torch.Tensor]]) -> None:
        # (first row, end row, view [S, rows, R'] or [rows, R']) per slice, in row order.
        self.parts = list(parts)

    @property
    def ndim(self) -> int:
        return self.parts[0][2].dim()

    @property
    def shape(self) -> torch.Size:
        view = self.parts[0][2]
        out = self.parts[-1][1]
        return torch.Size((view.shape[0], out, view.shape[2]) if self.ndim == 3 else (out, view.shape[1]))

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0][2].dtype

    def data_ptr(self) -> int:
        return self.parts[0][2].data_ptr()

    def __getitem__(self, index: Index) -> "SlicedB":
        if self.ndim == 3:
            if isinstance(index, tuple):
                slot, rest = index[0], index[1:]
                return self[slot][rest] if rest else self[slot]
            assert isinstance(index, int), f"index a folded B by slot first, got {index!r}"
            return SlicedB([(lo, hi, v[index]) for lo, hi, v in self.parts])
        index = index if isinstance(index, tuple) else (index,)
        rows, cols = (index + (slice(None), slice(None)))[:2]
        assert len(index) <= 2 and rows == slice(None), "a folded B slot is indexed by columns: B[slot][:, cols]"
        return SlicedB([(lo, hi, v[:, cols]) for lo, hi, v in self.parts])

    @torch.no_grad()
    def copy_(self, src: torch.Tensor, non_blocking: bool = False) -> "SlicedB":
        assert self.ndim == 2 and src.shape == self.shape, (tuple(src.shape), tuple(self.shape))
        for lo, hi, v in self.parts:
            v.copy_(src[lo:hi], non_blocking=non_blocking)
        return self

    @torch.no_grad()
    def zero_(self) -> "SlicedB":
        for _, _, v in self.parts:
            v.zero_()
        return self

    def dense(self) -> torch.Tensor:
        """A plain tensor of the same shape and values (a copy)."""
        return torch.cat([v for _, _, v in self.parts], dim=self.ndim - 2)


def folded_b(w_aug: torch.Tensor, in_dim: int, stack: int, max_rank: int, num_slots: int) -> tuple[torch.Tensor, int]:
    """The B of every slot as the expand kernels read it, [S, N, R], in place inside W_aug, and
    the column step between output slices (slice k's rank columns sit k*R past slice 0's).

    The view's rows are all N outputs; for slice k a kernel adds k * the step to its column
    offsets. Only the diagonal blocks are ever read: each slice reads its own rows."""
    n, width = w_aug.shape
    assert w_aug.stride(1) == 1 and width >= in_dim + num_slots * stack * max_rank, (w_aug.shape, in_dim)
    view = w_aug.as_strided((num_slots, n, max_rank), (stack * max_rank, w_aug.stride(0), 1),
                            w_aug.storage_offset() + in_dim)
    return view, max_rank


def fold_weight(
    weight: torch.Tensor, slice_sizes: Sequence[int], num_slots: int, max_rank: int, extra_cols: Optional[int] = None,
    a_rows: int = 0,
) -> tuple[torch.Tensor, SlicedB]:
    """W_aug [N, K + E] holding `weight` [N, K] and zero B blocks, and the SlicedB view of them.
    With `a_rows`, W_aug is the first N rows of a zero buffer [N + a_rows, K + E] whose last rows
    hold A for the A-fold (`a_fold_views`)."""
    n, k = weight.shape
    assert sum(slice_sizes) == n, (slice_sizes, n)
    c = len(slice_sizes)
    e = extra_cols if extra_cols is not None else fold_extra_columns(num_slots, c, max_rank)
    assert e >= num_slots * c * max_rank, (e, num_slots, c, max_rank)
    w_aug = torch.zeros(n + a_rows, k + e, dtype=weight.dtype, device=weight.device)[:n]
    w_aug[:, :k].copy_(weight)
    blocks = w_aug[:, k : k + num_slots * c * max_rank].view(n, num_slots, c, max_rank)
    parts, lo = [], 0
    for kk, size in enumerate(slice_sizes):
        parts.append((lo, lo + size, blocks[lo : lo + size, :, kk, :].permute(1, 0, 2)))  # [S, rows, R]
        lo += size
    return w_aug, SlicedB(parts)


def a_fold_views(w_aug: torch.Tensor, in_dim: int, num_slots: int, max_rank: int, gemm_slots: int, stack: int = 1
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The A-fold of a module (o_proj, down_proj; qkv_proj at prefill, `stack` 3) whose W_aug was
    built with `a_rows = num_slots * stack * max_rank`: A of every slot [S, c*R, K] (an adapter's
    slices compact in its block, as the pool writes A), in the buffer's rows past W_aug's N (so a
    slot write lands there), and W_a = [W; A of the first `gemm_slots` slots] [N + gemm_slots*c*R,
    K], whose one GEMM gives [x W^T | x A^T of every slot]: the base output and every slot's
    unscaled shrink. Both are views (the row stride of W_aug)."""
    n, width = w_aug.shape
    stride, block = w_aug.stride(0), stack * max_rank
    assert w_aug.stride(1) == 1 and width >= in_dim and gemm_slots <= num_slots, (w_aug.shape, in_dim)
    a = w_aug.as_strided((num_slots, block, in_dim), (block * stride, stride, 1), w_aug.storage_offset() + n * stride)
    w_a = w_aug.as_strided((n + gemm_slots * block, in_dim), (stride, 1), w_aug.storage_offset())
    return a, w_a
