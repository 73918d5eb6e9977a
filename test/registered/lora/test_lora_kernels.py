"""LoRA Triton kernels vs a plain torch reference (CPU, TRITON_INTERPRET=1, float32, tiny shapes).

Every case poisons what a kernel must not touch or read: rows outside segments and rows of rank-0
segments (sentinel values that must survive bit for bit), shrink-output columns past stack*rank,
A rows past stack*rank and B columns past rank (NaN, so any stray read shows up in the result).
"""

from __future__ import annotations

import pytest
import torch

from sglang.srt.lora.triton_ops import (
    chunked_sgmv_lora_expand_forward,
    chunked_sgmv_lora_shrink_forward,
    gate_up_lora_b_fwd,
    qkv_lora_b_fwd,
    sgemm_lora_a_fwd,
    sgemm_lora_b_fwd,
)
from sglang.srt.lora.utils import LoRABatchInfo

IN_DIM = 40  # not a multiple of the K tile
MAX_RANK = 16
# Slot 0 holds the base model (rank 0); slot 3 a rank that is not a multiple of 16.
RANKS = [0, 8, 16, 5]
SCALINGS = [0.0, 0.5, 2.0, 1.25]
SENTINEL = -777.0
Q, KV = 32, 16  # GQA: q and kv widths differ
INTER = 24
PLAIN_OUT = 40


def _poisoned_a(stack: int, gen: torch.Generator) -> torch.Tensor:
    a = torch.randn(len(RANKS), stack * MAX_RANK, IN_DIM, generator=gen)
    for slot, r in enumerate(RANKS):
        a[slot, stack * r :] = float("nan")  # beyond the adapter's compact prefix
    return a


def _poisoned_b(out_dim: int, gen: torch.Generator) -> torch.Tensor:
    b = torch.randn(len(RANKS), out_dim, MAX_RANK, generator=gen)
    for slot, r in enumerate(RANKS):
        b[slot, :, r:] = float("nan")
    return b


def _make_info(seg_lens: list[int], slots: list[int], max_len: int, perm=None) -> LoRABatchInfo:
    indptr = [0]
    for n in seg_lens:
        indptr.append(indptr[-1] + n)
    return LoRABatchInfo(
        bs=len(seg_lens),
        num_segments=len(seg_lens),
        max_len=max_len,
        seg_indptr=torch.tensor(indptr, dtype=torch.int32),
        weight_indices=torch.tensor(slots, dtype=torch.int32),
        lora_ranks=torch.tensor(RANKS, dtype=torch.int32),
        scalings=torch.tensor(SCALINGS, dtype=torch.float32),
        seg_lens=torch.tensor(seg_lens, dtype=torch.int32),
        permutation=None if perm is None else torch.as_tensor(perm, dtype=torch.int32),
    )


def _segments(info: LoRABatchInfo):
    """(token rows, slot, rank) of every segment, reading positions through the permutation."""
    indptr = info.seg_indptr.tolist()
    for seg in range(info.bs):
        slot = int(info.weight_indices[seg])
        pos = torch.arange(indptr[seg], indptr[seg + 1])
        rows = info.permutation[pos].long() if info.permutation is not None else pos
        yield rows, slot, RANKS[slot]


def ref_shrink(x, a, info, stack, out):
    out = out.clone()
    for rows, slot, r in _segments(info):
        if r > 0 and rows.numel() > 0:
            out[rows, : stack * r] = x[rows] @ a[slot, : stack * r].T
    return out


def ref_expand(xa, b, info, base, bounds):
    base = base.clone()
    for rows, slot, r in _segments(info):
        if r == 0 or rows.numel() == 0:
            continue
        for k, (lo, hi) in enumerate(bounds):
            base[rows, lo:hi] += SCALINGS[slot] * (xa[rows, k * r : (k + 1) * r] @ b[slot, lo:hi, :r].T)
    return base


def _shrink_output(num_tokens: int, stack: int) -> torch.Tensor:
    return torch.full((num_tokens, stack * MAX_RANK), SENTINEL)


def _shrunk_input(num_tokens: int, stack: int, gen: torch.Generator) -> torch.Tensor:
    """A shrink output as the expand sees it: garbage (NaN) past each row's live columns."""
    return torch.randn(num_tokens, stack * MAX_RANK, generator=gen)


def _poison_shrunk(xa: torch.Tensor, info: LoRABatchInfo, stack: int) -> torch.Tensor:
    xa = xa.clone()
    for rows, slot, r in _segments(info):
        xa[rows, stack * r :] = float("nan")
    return xa


# Segment layouts: (seg_lens, slots, trailing rows outside every segment).
# Uneven lengths, an empty segment, a rank-0 segment, a slot used twice, a segment longer than
# one token tile, and padded rows at the end.
TRITON_LAYOUTS = {
    "mixed": ([5, 0, 9, 3, 4], [1, 2, 0, 3, 2], 3),
    "long": ([40, 1, 7], [2, 3, 1], 2),  # max_len 40: 64-row token tiles, partial tile
    "decode": ([1, 1, 1, 1, 1, 1], [1, 0, 2, 3, 2, 1], 0),
}


def _triton_info(name: str):
    seg_lens, slots, pad = TRITON_LAYOUTS[name]
    info = _make_info(seg_lens, slots, max_len=max(seg_lens))
    return info, sum(seg_lens) + pad


@pytest.mark.parametrize("layout", list(TRITON_LAYOUTS))
@pytest.mark.parametrize("stack", [1, 2, 3])
def test_sgemm_lora_a(layout, stack):
    gen = torch.Generator().manual_seed(stack)
    info, num_tokens = _triton_info(layout)
    x = torch.randn(num_tokens, IN_DIM, generator=gen)
    a = _poisoned_a(stack, gen)
    out = _shrink_output(num_tokens, stack)
    got = sgemm_lora_a_fwd(x, a, info, stack_num=stack, out=out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got, ref_shrink(x, a, info, stack, _shrink_output(num_tokens, stack)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", list(TRITON_LAYOUTS))
def test_sgemm_lora_b(layout):
    gen = torch.Generator().manual_seed(11)
    info, num_tokens = _triton_info(layout)
    xa = _poison_shrunk(_shrunk_input(num_tokens, 1, gen), info, 1)
    b = _poisoned_b(PLAIN_OUT, gen)
    base = torch.full((num_tokens, PLAIN_OUT), SENTINEL)
    expected = ref_expand(xa, b, info, base, [(0, PLAIN_OUT)])
    got = sgemm_lora_b_fwd(xa, b, info, base)
    assert got.data_ptr() == base.data_ptr()  # in place
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    _assert_untouched_rows(got, info, num_tokens)


def _assert_untouched_rows(out: torch.Tensor, info: LoRABatchInfo, num_tokens: int) -> None:
    touched = torch.zeros(num_tokens, dtype=torch.bool)
    for rows, _, r in _segments(info):
        if r > 0:
            touched[rows] = True
    assert (~touched).any(), "layout must leave some rows untouched"
    assert torch.equal(out[~touched], torch.full_like(out[~touched], SENTINEL))


@pytest.mark.parametrize("layout", ["mixed", "decode"])
def test_qkv_lora_b_gqa(layout):
    gen = torch.Generator().manual_seed(5)
    info, num_tokens = _triton_info(layout)
    xa = _poison_shrunk(_shrunk_input(num_tokens, 3, gen), info, 3)
    b = _poisoned_b(Q + 2 * KV, gen)
    offsets = torch.tensor([0, Q, Q + KV, Q + 2 * KV], dtype=torch.int32)
    base = torch.full((num_tokens, Q + 2 * KV), SENTINEL)
    bounds = [(0, Q), (Q, Q + KV), (Q + KV, Q + 2 * KV)]
    expected = ref_expand(xa, b, info, base, bounds)
    got = qkv_lora_b_fwd(xa, b, info, offsets, max(Q, KV), base)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    _assert_untouched_rows(got, info, num_tokens)
    # Every slice really moved (a slice dropped by the grid would leave its columns at SENTINEL).
    active_row = 0  # segment 0 of every layout uses an adapter
    for lo, hi in bounds:
        assert not torch.equal(got[active_row, lo:hi], torch.full((hi - lo,), SENTINEL))


@pytest.mark.parametrize("layout", ["mixed", "long"])
def test_gate_up_lora_b(layout):
    gen = torch.Generator().manual_seed(6)
    info, num_tokens = _triton_info(layout)
    xa = _poison_shrunk(_shrunk_input(num_tokens, 2, gen), info, 2)
    b = _poisoned_b(2 * INTER, gen)
    base = torch.full((num_tokens, 2 * INTER), SENTINEL)
    expected = ref_expand(xa, b, info, base, [(0, INTER), (INTER, 2 * INTER)])
    got = gate_up_lora_b_fwd(xa, b, info, INTER, base)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    _assert_untouched_rows(got, info, num_tokens)


def test_shrink_then_expand_matches_dense_lora():
    """End to end through both kernels against the textbook formula s * x @ A^T @ B^T."""
    gen = torch.Generator().manual_seed(8)
    info, num_tokens = _triton_info("mixed")
    x = torch.randn(num_tokens, IN_DIM, generator=gen)
    a = _poisoned_a(1, gen)
    b = _poisoned_b(PLAIN_OUT, gen)
    base = torch.randn(num_tokens, PLAIN_OUT, generator=gen)
    expected = base.clone()
    for rows, slot, r in _segments(info):
        if r > 0:
            expected[rows] += SCALINGS[slot] * (x[rows] @ a[slot, :r].T @ b[slot, :, :r].T)
    got = sgemm_lora_b_fwd(sgemm_lora_a_fwd(x, a, info), b, info, base.clone())
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


# ---- chunked SGMV -----------------------------------------------------------------------------
def _csgmv_info(chunk: int, seed: int):
    """Tokens of a mixed batch sorted by slot, cut into chunks; base tokens and padding uncovered."""
    gen = torch.Generator().manual_seed(seed)
    # Per-token slots of a 4-request batch (A, base, B, A) plus 3 padded rows at the end.
    token_slots = [1] * 7 + [0] * 5 + [2] * 20 + [1] * 6
    num_tokens = len(token_slots) + 3
    order = torch.randperm(len(token_slots), generator=gen)  # scrambles rows: exercises the gather
    by_slot: dict[int, list[int]] = {}
    for row in order.tolist():
        by_slot.setdefault(token_slots[row], []).append(row)
    perm, seg_lens, slots = [], [], []
    for slot in (2, 1, 3, 0):  # slot 3 has no tokens; slot 0 (rank 0) gets chunks that must no-op
        rows = by_slot.get(slot, [])
        perm += rows
        for c in range(0, len(rows), chunk):
            seg_lens.append(min(chunk, len(rows) - c))
            slots.append(slot)
    seg_lens.append(0)  # a neutralised tail segment (zero length, stale slot)
    slots.append(2)
    perm += list(range(len(token_slots), num_tokens))
    return _make_info(seg_lens, slots, max_len=chunk, perm=perm), num_tokens


@pytest.mark.parametrize("chunk", [16, 32])
@pytest.mark.parametrize("num_slices", [1, 2, 3])
def test_chunked_sgmv_shrink(chunk, num_slices):
    info, num_tokens = _csgmv_info(chunk, seed=num_slices)
    gen = torch.Generator().manual_seed(100 + num_slices)
    x = torch.randn(num_tokens, IN_DIM, generator=gen)
    a = _poisoned_a(num_slices, gen)
    out = _shrink_output(num_tokens, num_slices)
    got = chunked_sgmv_lora_shrink_forward(x, a, info, num_slices, out=out)
    expected = ref_shrink(x, a, info, num_slices, _shrink_output(num_tokens, num_slices))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "num_slices,bounds",
    [
        (1, [(0, PLAIN_OUT)]),
        (2, [(0, INTER), (INTER, 2 * INTER)]),
        (3, [(0, Q), (Q, Q + KV), (Q + KV, Q + 2 * KV)]),
    ],
)
@pytest.mark.parametrize("chunk", [16, 32])
def test_chunked_sgmv_expand(num_slices, bounds, chunk):
    info, num_tokens = _csgmv_info(chunk, seed=7 * num_slices)
    gen = torch.Generator().manual_seed(200 + num_slices)
    out_dim = bounds[-1][1]
    xa = _poison_shrunk(_shrunk_input(num_tokens, num_slices, gen), info, num_slices)
    b = _poisoned_b(out_dim, gen)
    base = torch.full((num_tokens, out_dim), SENTINEL)
    expected = ref_expand(xa, b, info, base, bounds)
    if num_slices == 3:  # unequal slices through the offsets tensor
        offsets = torch.tensor([0, Q, Q + KV, Q + 2 * KV], dtype=torch.int32)
        got = chunked_sgmv_lora_expand_forward(xa, b, info, base, 3, offsets, max(Q, KV))
    else:
        got = chunked_sgmv_lora_expand_forward(xa, b, info, base, num_slices)
    assert got.data_ptr() == base.data_ptr()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    _assert_untouched_rows(got, info, num_tokens)


def test_all_rank_zero_is_a_noop():
    """The capture-time state of every static info: kernels launch, nothing changes."""
    gen = torch.Generator().manual_seed(3)
    info, num_tokens = _triton_info("mixed")
    info.lora_ranks = torch.zeros_like(info.lora_ranks)
    x = torch.randn(num_tokens, IN_DIM, generator=gen)
    out = _shrink_output(num_tokens, 3)
    sgemm_lora_a_fwd(x, _poisoned_a(3, gen), info, 3, out=out)
    assert torch.equal(out, _shrink_output(num_tokens, 3))
    base = torch.randn(num_tokens, Q + 2 * KV, generator=gen)
    before = base.clone()
    offsets = torch.tensor([0, Q, Q + KV, Q + 2 * KV], dtype=torch.int32)
    qkv_lora_b_fwd(torch.full((num_tokens, 3 * MAX_RANK), float("nan")), _poisoned_b(Q + 2 * KV, gen), info, offsets, Q, base)
    assert torch.equal(base, before)


@pytest.mark.parametrize("permuted", [False, True])
@pytest.mark.parametrize("split_k", [None, 2, 3])
def test_shrink_split_k(permuted, split_k):
    """Split-K partial sums (atomically added into a zeroed fp32 output) equal the plain shrink."""
    gen = torch.Generator().manual_seed(21)
    in_dim = 300 if split_k else 512  # None: the heuristic splits a 4-block K for this tiny batch
    if permuted:
        info, num_tokens = _csgmv_info(16, seed=4)
        shrink = chunked_sgmv_lora_shrink_forward
    else:
        info, num_tokens = _triton_info("mixed")
        shrink = sgemm_lora_a_fwd
    x = torch.randn(num_tokens, in_dim, generator=gen)
    a = torch.randn(len(RANKS), 2 * MAX_RANK, in_dim, generator=gen)
    for slot, r in enumerate(RANKS):
        a[slot, 2 * r :] = float("nan")
    got = shrink(x, a, info, 2, split_k=split_k)
    assert got.dtype == torch.float32
    expected = ref_shrink(x, a, info, 2, torch.zeros(num_tokens, 2 * MAX_RANK))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("programs_per_segment", [1, 2])
def test_token_lanes_walk_whole_segments(monkeypatch, programs_per_segment):
    """With fewer lanes than token tiles, each lane loops over its tiles (the graph-mode case:
    a segment may be as long as the bucket while the grid holds a fixed number of lanes)."""
    from sglang.srt.lora.triton_ops import _tiles

    monkeypatch.setattr(_tiles, "PROGRAMS_PER_SEGMENT", programs_per_segment)
    gen = torch.Generator().manual_seed(31)
    info, num_tokens = _triton_info("long")  # a 40-token segment: 3 shrink tiles of 16
    x = torch.randn(num_tokens, IN_DIM, generator=gen)
    a = _poisoned_a(3, gen)
    out = _shrink_output(num_tokens, 3)
    sgemm_lora_a_fwd(x, a, info, 3, out=out)
    torch.testing.assert_close(out, ref_shrink(x, a, info, 3, _shrink_output(num_tokens, 3)), rtol=1e-5, atol=1e-5)

    # A bucket-sized token axis (4 expand tiles of 64): lanes loop over them.
    long_info = _make_info([150, 7, 0, 33], [2, 0, 1, 3], max_len=200)
    rows = 150 + 7 + 33 + 2
    xa = _poison_shrunk(_shrunk_input(rows, 3, gen), long_info, 3)
    b = _poisoned_b(Q + 2 * KV, gen)
    base = torch.full((rows, Q + 2 * KV), SENTINEL)
    bounds = [(0, Q), (Q, Q + KV), (Q + KV, Q + 2 * KV)]
    expected = ref_expand(xa, b, long_info, base, bounds)
    offsets = torch.tensor([0, Q, Q + KV, Q + 2 * KV], dtype=torch.int32)
    got = qkv_lora_b_fwd(xa, b, long_info, offsets, max(Q, KV), base)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    _assert_untouched_rows(got, long_info, rows)
