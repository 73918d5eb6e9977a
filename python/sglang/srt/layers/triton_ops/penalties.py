"""The frequency, presence and repetition penalties of a batch's penalised rows in one pass.

The torch reference (sampling/logit_adjustments.py `penalize_reference`) gathers the rows' token
counts into a [P, V] copy, then makes several [P, V] passes (the fed token, counts > 0, the
repetition `where`s, the two subtractions) and writes the rows back. This kernel reads each
element's logit, count and prompt flag once, straight from the count table's rows (through the
table-row index), and writes the penalised logit in place: no copy of the counts.

Same bits as the reference: the same float32 operations in the same order,
    x = where(seen, where(x > 0, x / r, x * r), x)        (when a row has a repetition penalty)
    x = (x - f * float(count)) - p * float(count > 0)
with an IEEE division (div_rn: Triton's `/` on float32 is an approximate division) and without
multiply-add contraction (`enable_fp_fusion=False`: an FMA rounds once where torch rounds twice).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

# One program per (row, BLOCK columns): 64 x 151,936 gives 2,432 programs of 4 warps.
BLOCK = 2048
NUM_WARPS = 4


@triton.jit
def _penalties_kernel(
    OUT, stride_out,
    COUNTS, SEEN, stride_table,
    ROWS, TABLE_ROWS, PARAMS, n_pen,
    FED,
    n_cols,
    HAS_FED: tl.constexpr,
    WITH_PROMPT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    j = tl.program_id(0)
    row = tl.load(ROWS + j).to(tl.int64)
    table_row = tl.load(TABLE_ROWS + j).to(tl.int64)
    freq = tl.load(PARAMS + j)
    pres = tl.load(PARAMS + n_pen + j)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(OUT + row * stride_out + cols, mask=mask, other=0.0)
    count = tl.load(COUNTS + table_row * stride_table + cols, mask=mask, other=0)
    if HAS_FED:
        # The step's input token, sampled by a step the host has not seen yet: one more count.
        fed = tl.load(FED + row)
        count += (cols == fed).to(tl.int32)
    generated = count > 0
    if WITH_PROMPT:
        rep = tl.load(PARAMS + 2 * n_pen + j)
        seen = generated | (tl.load(SEEN + table_row * stride_table + cols, mask=mask, other=0) != 0)
        scaled = tl.where(x > 0, tl.math.div_rn(x, rep), x * rep)
        x = tl.where(seen, scaled, x)
    x = x - freq * count.to(tl.float32)
    x = x - pres * generated.to(tl.float32)
    tl.store(OUT + row * stride_out + cols, x, mask=mask)


def penalize_fused(
    out: torch.Tensor,
    rows: torch.Tensor,
    table_rows: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_seen: Optional[torch.Tensor],
    params: torch.Tensor,
    fed_tokens: Optional[torch.Tensor],
    block: int = BLOCK,
    num_warps: int = NUM_WARPS,
) -> None:
    """Penalise rows `rows` of float32 `out` [B, V] in place.

    `table_rows` int64 [P]: each row's row of `output_counts` (int32 [N, V]) and `prompt_seen`
    (bool [N, V]; None: no repetition penalty, the prompt is not read); `params` float32 [3, P]:
    frequency, presence, repetition per row; `fed_tokens` int64 [B] or None: a token per batch
    row to count on top of the table (the overlap schedule's token in flight)."""
    if out.dim() != 2 or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError("out must be a float32 [B, V] tensor with contiguous rows")
    n_pen, n_cols = rows.numel(), out.shape[1]
    assert output_counts.dtype == torch.int32 and output_counts.shape[1] == n_cols and output_counts.stride(1) == 1
    assert params.shape == (3, n_pen) and params.dtype == torch.float32 and params.is_contiguous()
    if n_pen == 0:
        return
    seen = prompt_seen.view(torch.uint8) if prompt_seen is not None else output_counts
    if prompt_seen is not None:
        assert prompt_seen.shape == output_counts.shape and prompt_seen.stride() == output_counts.stride()
    block = min(block, triton.next_power_of_2(n_cols))
    _penalties_kernel[(n_pen, triton.cdiv(n_cols, block))](
        out, out.stride(0),
        output_counts, seen, output_counts.stride(0),
        rows, table_rows, params, n_pen,
        fed_tokens if fed_tokens is not None else rows,
        n_cols,
        HAS_FED=fed_tokens is not None,
        WITH_PROMPT=prompt_seen is not None,
        BLOCK=block,
        num_warps=num_warps,
        enable_fp_fusion=False,
    )


__all__ = ["penalize_fused"]
