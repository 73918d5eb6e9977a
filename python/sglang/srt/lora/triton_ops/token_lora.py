"""Launch plans and entry points of the token-major LoRA kernels (token_shrink.py, token_expand.py).

A plan is a pure function of launch dimensions: the batch's row count (a static buffer size under
CUDA graphs) and the module's static shapes. A backend computes the plans of a batch once (in
prepare_lora_batch) and every layer reuses them, so a layer's LoRA call does no arithmetic on
shapes, allocates nothing and launches through a `PreparedLaunch` (launch.py).

Tile choices (H200, 132 SMs; to be confirmed by benchmark/lora/bench_lora_kernels.py):
  shrink   16-row tiles up to 256 rows, then 32 and 64 (A is re-read from L2 once per token
           tile); the whole stacked rank in one column tile up to 128; 256-deep K tiles for 16-bit
           inputs. K is split until the grid has about SHRINK_TARGET_PROGRAMS programs (at most
           MAX_SPLIT, at least one K tile each): decode and short prefills are latency-bound
           reductions over up to 14336 inputs otherwise.
  expand   16-row tiles for decode-sized batches, 64 beyond; 128-wide column tiles. It is a
           read-modify-write of the base output, bandwidth-bound from a few hundred rows up.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton

from sglang.srt.lora.triton_ops._tiles import dot_precision, rank_block
from sglang.srt.lora.triton_ops.launch import BoundKernel, PreparedLaunch
from sglang.srt.lora.triton_ops.sgemm_lora_b import qkv_offset_alignment
from sglang.srt.lora.triton_ops.token_expand import _token_expand_kernel
from sglang.srt.lora.triton_ops.token_shrink import _token_shrink_kernel

SHRINK_TARGET_PROGRAMS = 256
MAX_SPLIT = 16


@dataclass(frozen=True)
class ShrinkPlan:
    num_rows: int
    in_dim: int
    stacked_rank: int
    block_s: int
    block_n: int
    block_k: int
    n_tiles: int
    split: int
    k_per_split: int

    @property
    def token_tiles(self) -> int:
        return triton.cdiv(self.num_rows, self.block_s)

    @property
    def grid(self) -> tuple[int]:
        return (self.token_tiles * self.n_tiles * self.split,)

    @property
    def workspace_numel(self) -> int:
        """fp32 elements of the split-K partials ([split, rows, n_tiles * block_n]); 0 unsplit."""
        return self.split * self.num_rows * self.n_tiles * self.block_n if self.split > 1 else 0

    @property
    def num_counters(self) -> int:
        return self.token_tiles * self.n_tiles if self.split > 1 else 0


def plan_shrink(num_rows: int, in_dim: int, stacked_rank: int, elem_size: int) -> ShrinkPlan:
    if num_rows <= 256:
        block_s = 16
    elif num_rows <= 1024:
        block_s = 32
    else:
        block_s = 64
    block_n = rank_block(stacked_rank, cap=128)
    n_tiles = triton.cdiv(stacked_rank, block_n)
    # Stage bytes (x tile + A tile) near 32 KB: 256-deep for 16-bit inputs and tiles up to 64 wide.
    depth = 256 if max(block_s, block_n) <= 64 else 128
    if elem_size > 2:
        depth //= 2
    block_k = min(depth, max(16, triton.next_power_of_2(in_dim)))
    k_blocks = triton.cdiv(in_dim, block_k)
    programs = triton.cdiv(max(num_rows, 1), block_s) * n_tiles
    split = max(1, min(MAX_SPLIT, k_blocks, triton.cdiv(SHRINK_TARGET_PROGRAMS, programs)))
    k_per_split = triton.cdiv(k_blocks, split) * block_k
    split = triton.cdiv(in_dim, k_per_split)  # no empty splits
    return ShrinkPlan(num_rows, in_dim, stacked_rank, block_s, block_n, block_k, n_tiles, split, k_per_split)


def with_split(plan: ShrinkPlan, split: int) -> ShrinkPlan:
    """The same plan with K split `split` ways (fewer if K has fewer tiles): tuning and tests."""
    k_blocks = triton.cdiv(plan.in_dim, plan.block_k)
    k_per_split = triton.cdiv(k_blocks, max(1, min(split, k_blocks))) * plan.block_k
    return dataclasses.replace(plan, split=triton.cdiv(plan.in_dim, k_per_split), k_per_split=k_per_split)


@dataclass(frozen=True)
class ExpandPlan:
    num_rows: int
    num_slices: int
    slice_width: int  # equal slices; 0 when given by offsets
    max_slice_width: int
    max_rank: int
    block_s: int
    block_n: int
    block_r: int
    n_tiles: int

    @property
    def grid(self) -> tuple[int, int]:
        return (triton.cdiv(self.num_rows, self.block_s) * self.n_tiles, self.num_slices)


def plan_expand(
    num_rows: int, out_dim: int, num_slices: int, max_rank: int, max_slice_width: Optional[int] = None
) -> ExpandPlan:
    """Equal slices when max_slice_width is None (out_dim / num_slices each)."""
    if max_slice_width is None:
        assert out_dim % num_slices == 0, (out_dim, num_slices)
        slice_width = max_slice_width = out_dim // num_slices
    else:
        slice_width = 0
    block_s = 16 if num_rows <= 32 else 64
    block_n = min(128, max(16, triton.next_power_of_2(max_slice_width)))
    n_tiles = triton.cdiv(max_slice_width, block_n)
    return ExpandPlan(
        num_rows, num_slices, slice_width, max_slice_width, max_rank, block_s, block_n, rank_block(max_rank), n_tiles
    )


@functools.lru_cache(maxsize=None)
def _bound_shrink(stack: int, block_s: int, block_n: int, block_k: int, split: int, dot_prec: str, use_pdl: bool) -> BoundKernel:
    # The shrink itself is launched normally (it does not wait for its predecessor); with use_pdl
    # it only lets its dependent expand start early.
    options = {"num_warps": 4}
    return BoundKernel(
        _token_shrink_kernel,
        dict(STACK=stack, BLOCK_S=block_s, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split, DOT_PREC=dot_prec,
             USE_PDL=use_pdl),
        **options,
    )


@functools.lru_cache(maxsize=None)
def _bound_expand(
    has_offsets: bool, offset_align: int, block_s: int, block_n: int, block_r: int, dot_prec: str, use_pdl: bool
) -> BoundKernel:
    options = {"num_warps": 4}
    if use_pdl:
        options["launch_pdl"] = True
    return BoundKernel(
        _token_expand_kernel,
        dict(HAS_OFFSETS=has_offsets, OFFSET_ALIGN=offset_align, BLOCK_S=block_s, BLOCK_N=block_n,
             BLOCK_R=block_r, DOT_PREC=dot_prec, USE_PDL=use_pdl),
        **options,
    )


def prepare_shrink(
    plan: ShrinkPlan, x: torch.Tensor, weights: torch.Tensor, out_stride: int, stack_num: int, use_pdl: bool = False
) -> PreparedLaunch:
    """The launch of one module kind for one batch. x and weights are examples of what the layers
    will pass: only their (static) strides and dtypes are read here."""
    assert x.stride(1) == 1 and weights.stride(2) == 1, "K must be the contiguous dimension"
    assert weights.numel() < 2**31, "weight offsets are 32-bit in the kernel"
    bound = _bound_shrink(
        stack_num, plan.block_s, plan.block_n, plan.block_k, plan.split, dot_precision(x, weights), use_pdl
    )
    part_plane = plan.num_rows * plan.n_tiles * plan.block_n
    ints = (
        plan.num_rows, part_plane, plan.in_dim, plan.k_per_split,
        x.stride(0), weights.stride(0), weights.stride(1), out_stride, plan.n_tiles,
    )
    return bound.prepare(plan.grid, ints)


def prepare_expand(
    plan: ExpandPlan,
    weights: torch.Tensor,
    xa_stride: int,
    out_stride: int,
    has_offsets: bool,
    use_pdl: bool = False,
) -> PreparedLaunch:
    assert weights.stride(2) == 1, "the rank must be B's contiguous dimension"
    assert weights.numel() < 2**31, "weight offsets are 32-bit in the kernel"
    out_dim = weights.shape[1]
    offset_align = qkv_offset_alignment(out_dim, plan.max_slice_width) if has_offsets else 1
    bound = _bound_expand(
        has_offsets, offset_align, plan.block_s, plan.block_n, plan.block_r, dot_precision(weights), use_pdl
    )
    ints = (
        plan.num_rows, plan.slice_width, plan.n_tiles, xa_stride, weights.stride(0), weights.stride(1), out_stride,
    )
    return bound.prepare(plan.grid, ints)


# ---- one-call entry points (tests, benchmark; a backend keeps the prepared launches instead) ----
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
    if plan is None:
        plan = plan_shrink(num_rows, in_dim, stacked_rank, x.element_size())
    if out is None:
        out = torch.empty((num_rows, stacked_rank), dtype=x.dtype, device=x.device)
    if plan.split > 1:
        if workspace is None:
            workspace = torch.empty(plan.workspace_numel, dtype=torch.float32, device=x.device)
        if counters is None:
            counters = torch.zeros(plan.num_counters, dtype=torch.int32, device=x.device)
        assert workspace.numel() >= plan.workspace_numel and counters.numel() >= plan.num_counters
    else:  # unused by the kernel; any int32 / fp32 tensors do
        workspace = workspace if workspace is not None else out
        counters = counters if counters is not None else token_slots
    if num_rows == 0:
        return out
    assert out.shape == (num_rows, stacked_rank) and out.stride(1) == 1, out.shape
    launch = prepare_shrink(plan, x, weights, out.stride(0), stack_num, use_pdl)
    launch(x, weights, out, workspace, counters, token_slots, lora_ranks)
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
    if plan is None:
        plan = plan_expand(num_rows, out_dim, num_slices, max_rank, max_slice_width)
    if num_rows == 0:
        return base_output
    launch = prepare_expand(plan, weights, xa.stride(0), base_output.stride(0), slice_offsets is not None, use_pdl)
    offsets = slice_offsets if slice_offsets is not None else token_slots  # unused without offsets
    launch(xa, weights, base_output, token_slots, lora_ranks, scalings, offsets)
    return base_output
