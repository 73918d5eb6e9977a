"""Launch-shape helpers of the segmented (chunked SGMV) kernels, shared with the token-major ones.

Everything here is a pure function of launch dimensions that are frozen under CUDA graphs
(`batch_info.bs`, `batch_info.max_len`), of weight shapes, or of the row count of x (a static
buffer under graphs), never of live per-batch data. So a graph captured once keeps a grid that
is valid for every later batch whose metadata is refreshed in place.

The token axis of a grid is a number of *lanes* per segment: lane i handles token tiles
i, i + lanes, ..., i + (LANE_ITERS - 1) * lanes of its segment, skipping those past the segment
end. Together they cover max_len rows, so every segment no longer than max_len is covered, while
the grid need not hold max_len / BLOCK_S programs for every segment slot. Lanes are sized so that
one long segment alone still fills the GPU.

Every loop in the kernels has a constexpr trip count (masked or skipped past the live bound):
Triton 3.6's interpreter cannot take a runtime value as a loop bound under NumPy >= 2.4, and the
few values these counts take (powers of two, fixed shapes) keep the compile cache small.
"""

from __future__ import annotations

import triton

# Programs one segment should be able to occupy: about two per SM of an H200 (132 SMs).
PROGRAMS_PER_SEGMENT = 256


def token_block(max_len: int) -> int:
    """Rows per tile for the expand: 16 (the smallest `tl.dot` tile) up to 64 for long segments."""
    if max_len <= 16:
        return 16
    if max_len <= 32:
        return 32
    return 64


def token_lanes(max_len: int, block_s: int, programs_per_lane: int) -> tuple[int, int]:
    """(lanes per segment, tiles per lane) covering max_len rows in tiles of block_s.

    Lanes aim at PROGRAMS_PER_SEGMENT programs per segment; tiles per lane is rounded up to a
    power of two because it is a compile-time constant of the kernel.
    """
    if max_len <= 0:
        return 0, 1
    tiles = triton.cdiv(max_len, block_s)
    wanted = max(1, min(tiles, triton.cdiv(PROGRAMS_PER_SEGMENT, max(1, programs_per_lane))))
    iters = triton.next_power_of_2(triton.cdiv(tiles, wanted))
    return triton.cdiv(tiles, iters), iters


def rank_block(max_rank_cols: int, cap: int = 64) -> int:
    """A power-of-two tile (>= 16, <= cap) covering up to `max_rank_cols` columns."""
    return max(16, min(cap, triton.next_power_of_2(max(1, max_rank_cols))))


