"""Launch plans and entry points of the token-major LoRA kernels (shrink_pack.py, token_shrink.py,
token_expand.py).

A plan is a pure function of a module's static shapes (input width, stacked rank, slices, dtype)
and of the segment size: never of the batch. Tile shapes and the K split decide the order in which
each row's sums are accumulated, so a graph captured on a padded bucket and an eager pass over the
live rows compute every row bit for bit alike. Only the grid depends on the batch: one program
column per segment (`plan.grid(num_segments)`, lora/segments.py).
A backend turns a plan into a `PreparedLaunch` (launch.py) once per batch and module kind; every
layer then launches it with its own tensors: no shape arithmetic, allocation or binding per call.

Tile choices (H200; see benchmark/lora/bench_lora_kernels.py):
  shrink / shrink_pack  one segment (16 rows for `triton`, csgmv's chunk) of one slot per program:
           its adapter's A tile is read once for all of them; column tiles of up to 32 of the
           stacked rank (SHRINK_MAX_COLS), 256-deep K tiles for 16-bit inputs. K is split in pieces of about
           K_PER_SPLIT (one K tile per program, at most MAX_SPLIT pieces), so decode and short
           prefills are not one long serial reduction.
  expand   one segment per program, 128-wide column tiles; a read-modify-write of the base output.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton

from sglang.srt.layers.triton_ops.common import dot_precision, pdl_available
from sglang.srt.lora.segments import build_segments, idle_slot_of
from sglang.srt.lora.triton_ops._tiles import rank_block
from sglang.srt.lora.triton_ops.launch import BoundKernel, PreparedLaunch
from sglang.srt.lora.triton_ops.shrink_pack import _shrink_pack_kernel
from sglang.srt.lora.triton_ops.sgemm_lora_b import qkv_offset_alignment
from sglang.srt.lora.triton_ops.token_expand import _token_expand_kernel
from sglang.srt.lora.triton_ops.token_shrink import _token_shrink_kernel

SEGMENT_ROWS = 16  # `triton`'s segment size: the smallest `tl.dot` tile
# One 256-deep K tile per program where K allows (up to MAX_SPLIT): with one slot per segment the
# programs are short and latency-bound, and the H200 sweep of 2026-12-01 (bench_lora_kernels
# --tunings) measured 512 -> 256 at -15% LoRA µs per layer at decode 1 and 64 (k128: the same plans).
K_PER_SPLIT = 256
MAX_SPLIT = 32
SHRINK_MAX_COLS = 32
PACK_BLOCK_E = 128  # the widest zero stripe of shrink_pack (pack_block_e)
K_DEPTH_16BIT = 256  # K tile of 16-bit inputs with tiles up to 64 wide (halved past that, and for fp32)
NUM_WARPS = 4


@dataclass(frozen=True)
class ShrinkPlan:
    in_dim: int
    stacked_rank: int
    block_s: int
    block_n: int
    block_k: int
    n_tiles: int
    split: int
    k_per_split: int

    def grid(self, num_segments: int) -> tuple[int]:
        return (num_segments * self.n_tiles * self.split,)

    def workspace_numel(self, num_rows: int) -> int:
        """fp32 elements of the split-K partials ([split, rows, n_tiles * block_n]); 0 unsplit."""
        return self.split * num_rows * self.n_tiles * self.block_n if self.split > 1 else 0

    def num_counters(self, num_segments: int) -> int:
        return num_segments * self.n_tiles if self.split > 1 else 0

    def ints(self, num_rows: int) -> tuple[int, int, int, int]:
        """num_rows, part_plane, K, k_per_split: the kernels' first int arguments."""
        return num_rows, num_rows * self.n_tiles * self.block_n, self.in_dim, self.k_per_split


@functools.lru_cache(maxsize=None)
def plan_shrink(in_dim: int, stacked_rank: int, elem_size: int, block_s: int = SEGMENT_ROWS) -> ShrinkPlan:
    # At most 32 columns per program: a wider stack (qkv's 3 x r) takes more, shorter programs,
    # whose latencies overlap. H200, Llama-8B, graph grid (benchmark/lora/probe_shrink_pack.py):
    # qkv at rank 16 7.8 against 10.1 µs at 128 rows (+0.7 at 512, +2.2 at 2048); at rank 64
    # 13.6 / 28.1 / 83.1 against 21.5 / 41.1 / 95.0 µs for the former 128-wide tile.
    block_n = rank_block(stacked_rank, cap=SHRINK_MAX_COLS)
    n_tiles = triton.cdiv(stacked_rank, block_n)
    # Stage bytes (x tile + A tile) near 32 KB: 256-deep for 16-bit inputs and tiles up to 64 wide.
    depth = K_DEPTH_16BIT if max(block_s, block_n) <= 64 else K_DEPTH_16BIT // 2
    if elem_size > 2:
        depth //= 2
    block_k = min(depth, max(16, triton.next_power_of_2(in_dim)))
    plan = ShrinkPlan(in_dim, stacked_rank, block_s, block_n, block_k, n_tiles, 1, triton.cdiv(in_dim, block_k) * block_k)
    return with_split(plan, min(MAX_SPLIT, triton.cdiv(in_dim, K_PER_SPLIT)))


def with_split(plan: ShrinkPlan, split: int) -> ShrinkPlan:
    """The same plan with K split `split` ways (fewer if K has fewer tiles); no empty splits."""
    k_blocks = triton.cdiv(plan.in_dim, plan.block_k)
    k_per_split = triton.cdiv(k_blocks, max(1, min(split, k_blocks))) * plan.block_k
    return dataclasses.replace(plan, split=triton.cdiv(plan.in_dim, k_per_split), k_per_split=k_per_split)


@dataclass(frozen=True)
class PackPlan:
    """shrink_pack of a folded module: the shrink's tiling plus the packed block layout."""

    shrink: ShrinkPlan
    stack: int
    max_rank: int
    extra_cols: int  # E: the extra columns of x_aug / W_aug (S*c*R plus padding)

    def grid(self, num_segments: int) -> tuple[int]:
        return self.shrink.grid(num_segments)


@functools.lru_cache(maxsize=None)
def plan_pack(
    in_dim: int, stack: int, max_rank: int, extra_cols: int, elem_size: int, block_s: int = SEGMENT_ROWS
) -> PackPlan:
    return PackPlan(plan_shrink(in_dim, stack * max_rank, elem_size, block_s), stack, max_rank, extra_cols)


@dataclass(frozen=True)
class ExpandPlan:
    out_dim: int
    num_slices: int
    slice_width: int  # equal slices; 0 when given by offsets
    max_slice_width: int
    max_rank: int
    block_s: int
    block_n: int
    block_r: int
    n_tiles: int

    def grid(self, num_segments: int) -> tuple[int, int]:
        return (num_segments * self.n_tiles, self.num_slices)


@functools.lru_cache(maxsize=None)
def plan_expand(
    out_dim: int, num_slices: int, max_rank: int, max_slice_width: Optional[int] = None, block_s: int = SEGMENT_ROWS
) -> ExpandPlan:
    """Equal slices when max_slice_width is None (out_dim / num_slices each)."""
    if max_slice_width is None:
        assert out_dim % num_slices == 0, (out_dim, num_slices)
        slice_width = max_slice_width = out_dim // num_slices
    else:
        slice_width = 0
    block_n = min(128, max(16, triton.next_power_of_2(max_slice_width)))
    n_tiles = triton.cdiv(max_slice_width, block_n)
    return ExpandPlan(
        out_dim, num_slices, slice_width, max_slice_width, max_rank, block_s, block_n, rank_block(max_rank),
        n_tiles,
    )


# ---- bound kernels (one per specialisation) ---------------------------------------------------
def _options(use_pdl: bool) -> dict:
    options = {"num_warps": NUM_WARPS}
    if use_pdl:
        options["launch_pdl"] = True
    return options


@functools.lru_cache(maxsize=None)
def _bound_shrink(stack: int, block_s: int, block_n: int, block_k: int, split: int, dot_prec: str, use_pdl: bool) -> BoundKernel:
    # The shrink itself is launched normally (it does not wait for its predecessor); with use_pdl
    # it only lets its dependent expand start early.
    return BoundKernel(
        _token_shrink_kernel,
        dict(STACK=stack, BLOCK_S=block_s, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split, DOT_PREC=dot_prec,
             USE_PDL=use_pdl),
        num_warps=NUM_WARPS,
    )


@functools.lru_cache(maxsize=None)
def _bound_expand(
    has_offsets: bool, offset_align: int, block_s: int, block_n: int, block_r: int, dot_prec: str, use_pdl: bool
) -> BoundKernel:
    return BoundKernel(
        _token_expand_kernel,
        dict(HAS_OFFSETS=has_offsets, OFFSET_ALIGN=offset_align, BLOCK_S=block_s, BLOCK_N=block_n,
             BLOCK_R=block_r, DOT_PREC=dot_prec, USE_PDL=use_pdl),
        **_options(use_pdl),
    )


def pack_block_e(plan: PackPlan) -> int:
    """shrink_pack's zero stripe: E dealt out over a segment's programs, about one stripe each."""
    per_program = triton.cdiv(plan.extra_cols, plan.shrink.n_tiles * plan.shrink.split)
    return max(16, min(PACK_BLOCK_E, triton.next_power_of_2(per_program)))


@functools.lru_cache(maxsize=None)
def _bound_pack(plan: PackPlan, dot_prec: str, use_pdl: bool, copy_x: bool = True) -> BoundKernel:
    s = plan.shrink
    return BoundKernel(
        _shrink_pack_kernel,
        dict(STACK=plan.stack, MAX_RANK=plan.max_rank, E_COLS=plan.extra_cols, BLOCK_S=s.block_s,
             BLOCK_N=s.block_n, BLOCK_K=s.block_k, BLOCK_E=pack_block_e(plan), SPLIT=s.split, DOT_PREC=dot_prec,
             USE_PDL=use_pdl, COPY_X=copy_x),
        **_options(use_pdl),
    )


# ---- prepared launches (per batch and module kind) --------------------------------------------
# Every kernel takes the batch's segment metadata (lora/segments.py) as its tensors
# `perm, seg_indptr, weight_indices` after its data tensors; the grid has one program column per
# segment of the batch (eager) or of the bucket's capacity (graphs).
def prepare_shrink(
    plan: ShrinkPlan, num_rows: int, num_segments: int, x: torch.Tensor, weights: torch.Tensor, out_stride: int,
    stack_num: int, use_pdl: bool = False,
) -> PreparedLaunch:
    """The shrink of one module kind for one batch. x and weights are examples of what the layers
    will pass: only their (static) strides and dtypes are read here."""
    assert x.stride(1) == 1 and weights.stride(2) == 1, "K must be the contiguous dimension"
    assert weights.numel() < 2**31, "weight offsets are 32-bit in the kernel"
    bound = _bound_shrink(
        stack_num, plan.block_s, plan.block_n, plan.block_k, plan.split, dot_precision(x, weights), use_pdl
    )
    ints = plan.ints(num_rows) + (x.stride(0), weights.stride(0), weights.stride(1), out_stride, plan.n_tiles)
    return bound.prepare(plan.grid(num_segments), ints)


def prepare_expand(
    plan: ExpandPlan,
    num_rows: int,
    num_segments: int,
    weights: torch.Tensor,
    xa_stride: int,
    out_stride: int,
    has_offsets: bool,
    use_pdl: bool = False,
) -> PreparedLaunch:
    assert weights.stride(2) == 1, "the rank must be B's contiguous dimension"
    assert weights.numel() < 2**31, "weight offsets are 32-bit in the kernel"
    offset_align = qkv_offset_alignment(plan.out_dim, plan.max_slice_width) if has_offsets else 1
    bound = _bound_expand(
        has_offsets, offset_align, plan.block_s, plan.block_n, plan.block_r, dot_precision(weights), use_pdl
    )
    ints = (
        num_rows, plan.slice_width, plan.n_tiles, xa_stride, weights.stride(0), weights.stride(1), out_stride,
    )
    return bound.prepare(plan.grid(num_segments), ints)


def prepare_pack(
    plan: PackPlan, num_rows: int, num_segments: int, x: torch.Tensor, weights: torch.Tensor, xaug_stride: int,
    use_pdl: bool = False, copy_x: bool = True,
) -> PreparedLaunch:
    """shrink_pack of one folded module kind for one batch (x, weights: examples, as above).
    copy_x False: x will be x_aug[:, :K] itself (row stride xaug_stride), already in place."""
    assert x.stride(1) == 1 and weights.stride(2) == 1, "K must be the contiguous dimension"
    assert weights.numel() < 2**31 and num_rows * xaug_stride < 2**31, "offsets are 32-bit in the kernel"
    assert copy_x or x.stride(0) == xaug_stride, "in place, x is x_aug's first columns"
    s = plan.shrink
    bound = _bound_pack(plan, dot_precision(x, weights), use_pdl, copy_x)
    ints = s.ints(num_rows) + (x.stride(0), weights.stride(0), weights.stride(1), xaug_stride, s.n_tiles)
    return bound.prepare(plan.grid(num_segments), ints)


# ---- one-call entry points (tests, benchmark; a backend keeps the prepared launches instead) ----
def token_segments(
    token_slots: torch.Tensor, lora_ranks: torch.Tensor, block_s: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(perm, seg_indptr, weight_indices, number of segments) of rows whose slots are `token_slots`
    (int32 [rows], -1 = no request): each row its own request. Reads both tensors on the host."""
    ranks = lora_ranks.tolist()
    segs = build_segments(token_slots.tolist(), [1] * token_slots.numel(), ranks, block_s, token_slots.numel(),
                          idle_slot_of(ranks))
    dev = token_slots.device
    as_i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=dev)  # noqa: E731
    return segs.permutation.to(dev), as_i32(segs.seg_indptr), as_i32(segs.weight_indices or [0]), segs.num_segments


def _split_buffers(plan: ShrinkPlan, num_rows: int, num_segments: int, device, workspace, counters, fallback_f32,
                   fallback_i32):
    if plan.split > 1:
        if workspace is None:
            workspace = torch.empty(plan.workspace_numel(num_rows), dtype=torch.float32, device=device)
        if counters is None:
            counters = torch.zeros(plan.num_counters(num_segments), dtype=torch.int32, device=device)
        assert workspace.numel() >= plan.workspace_numel(num_rows)
        assert counters.numel() >= plan.num_counters(num_segments)
        return workspace, counters
    # Unused by the kernel; any fp32 / int32 tensors do.
    return (workspace if workspace is not None else fallback_f32), (counters if counters is not None else fallback_i32)


def token_shrink(
    x: torch.Tensor,
    weights: torch.Tensor,
    token_slots: torch.Tensor,
    lora_ranks: torch.Tensor,
    stack_num: int,
    out: Optional[torch.Tensor] = None,
    workspace: Optional[torch.Tensor] = None,
    counters: Optional[torch.Tensor] = None,
    plan: Optional[ShrinkPlan] = None,
    use_pdl: bool = False,
) -> torch.Tensor:
    """out[t, :c*r] = x[t] @ A[slot(t), :c*r].T for rows with an active slot; nothing else written."""
    num_rows, in_dim = x.shape
    stacked_rank = weights.shape[1]
    assert weights.shape[2] == in_dim and stacked_rank % stack_num == 0, (x.shape, weights.shape)
    plan = plan or plan_shrink(in_dim, stacked_rank, x.element_size())
    if out is None:
        out = torch.empty((num_rows, stacked_rank), dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    perm, indptr, slots, n_segs = token_segments(token_slots, lora_ranks, plan.block_s)
    workspace, counters = _split_buffers(plan, num_rows, n_segs, x.device, workspace, counters, lora_ranks.float(),
                                         token_slots)
    assert out.shape == (num_rows, stacked_rank) and out.stride(1) == 1, out.shape
    launch = prepare_shrink(plan, num_rows, n_segs, x, weights, out.stride(0), stack_num, use_pdl)
    launch(x, weights, out, workspace, counters, perm, indptr, slots, lora_ranks)
    return out


def token_expand(
    xa: torch.Tensor,
    weights: torch.Tensor,
    token_slots: torch.Tensor,
    lora_ranks: torch.Tensor,
    scalings: torch.Tensor,
    base_output: torch.Tensor,
    num_slices: int,
    slice_offsets: Optional[torch.Tensor] = None,
    max_slice_width: Optional[int] = None,
    plan: Optional[ExpandPlan] = None,
    use_pdl: bool = False,
) -> torch.Tensor:
    """base_output[t, slice k] += scaling * xa[t, k*r:(k+1)*r] @ B[slot(t), slice k, :r].T, in place."""
    num_rows = xa.shape[0]
    _, out_dim, max_rank = weights.shape
    assert base_output.shape == (num_rows, out_dim) and base_output.stride(1) == 1, base_output.shape
    assert xa.stride(1) == 1 and xa.shape[1] >= num_slices * max_rank, xa.shape
    if slice_offsets is not None:
        assert slice_offsets.numel() == num_slices + 1 and max_slice_width is not None
    plan = plan or plan_expand(out_dim, num_slices, max_rank, max_slice_width if slice_offsets is not None else None)
    if num_rows == 0:
        return base_output
    perm, indptr, slots, n_segs = token_segments(token_slots, lora_ranks, plan.block_s)
    launch = prepare_expand(plan, num_rows, n_segs, weights, xa.stride(0), base_output.stride(0),
                            slice_offsets is not None, use_pdl)
    offsets = slice_offsets if slice_offsets is not None else indptr  # unused without offsets
    launch(xa, weights, base_output, perm, indptr, slots, lora_ranks, scalings, offsets)
    return base_output


def shrink_pack(
    x: torch.Tensor,
    weights: torch.Tensor,
    x_aug: torch.Tensor,
    token_slots: torch.Tensor,
    lora_ranks: torch.Tensor,
    scalings: torch.Tensor,
    stack_num: int,
    max_rank: int,
    workspace: Optional[torch.Tensor] = None,
    counters: Optional[torch.Tensor] = None,
    plan: Optional[PackPlan] = None,
    use_pdl: bool = False,
) -> torch.Tensor:
    """Write x_aug [T, K + E] = [x | packed pre-scaled shrink] (see shrink_pack.py). Returns x_aug."""
    num_rows, in_dim = x.shape
    extra = x_aug.shape[1] - in_dim
    assert weights.shape == (weights.shape[0], stack_num * max_rank, in_dim), (weights.shape, stack_num, max_rank)
    # Every slot but the last (the base model's, rank 0) has a block in E.
    assert x_aug.shape[0] == num_rows and x_aug.stride(1) == 1
    assert extra >= (weights.shape[0] - 1) * stack_num * max_rank, (extra, weights.shape)
    plan = plan or plan_pack(in_dim, stack_num, max_rank, extra, x.element_size())
    assert plan.extra_cols == extra, (plan.extra_cols, extra)
    if num_rows == 0:
        return x_aug
    perm, indptr, slots, n_segs = token_segments(token_slots, lora_ranks, plan.shrink.block_s)
    workspace, counters = _split_buffers(plan.shrink, num_rows, n_segs, x.device, workspace, counters, scalings,
                                         token_slots)
    launch = prepare_pack(plan, num_rows, n_segs, x, weights, x_aug.stride(0), use_pdl)
    launch(x, weights, x_aug, workspace, counters, perm, indptr, slots, lora_ranks, scalings)
    return x_aug
