"""csgmv's chunked SGMV kernels vs a plain torch reference (CPU, TRITON_INTERPRET=1, float32, tiny
shapes). (The token-major kernels: test_lora_token_kernels.py; their constants and poisoning come
from here.)

Every case poisons what a kernel must not touch or read: rows outside segments and rows of rank-0
segments (sentinel values that must survive bit for bit), shrink-output columns past stack*rank,
A rows past stack*rank and B columns past rank (NaN, so any stray read shows up in the result).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl  # noqa: F401 (a @triton.jit function's module must see it)

from sglang.srt.lora.triton_ops import chunked_sgmv_lora_expand_forward, chunked_sgmv_lora_shrink_forward
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
        num_rows=sum(seg_lens),
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


def _assert_untouched_rows(out: torch.Tensor, info: LoRABatchInfo, num_tokens: int) -> None:
    touched = torch.zeros(num_tokens, dtype=torch.bool)
    for rows, _, r in _segments(info):
        if r > 0:
            touched[rows] = True
    assert (~touched).any(), "layout must leave some rows untouched"
    assert torch.equal(out[~touched], torch.full_like(out[~touched], SENTINEL))


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


def _folded_case(slice_sizes: tuple[int, ...], info, num_tokens: int, seed: int):
    """A module of these output slices, folded: (each row's compact shrink xa (poisoned past its
    rank), the plain B, B's view inside W_aug and its slice step, the slice offsets and widest
    slice for qkv's unequal slices, else None)."""
    from sglang.srt.lora.fold import fold_weight, folded_b

    c, out_dim = len(slice_sizes), sum(slice_sizes)
    gen = torch.Generator().manual_seed(seed)
    xa = _poison_shrunk(_shrunk_input(num_tokens, c, gen), info, c)
    b = _poisoned_b(out_dim, gen)
    w_aug, sliced = fold_weight(torch.randn(out_dim, IN_DIM, generator=gen), slice_sizes, len(RANKS), MAX_RANK)
    for slot in range(len(RANKS)):
        sliced[slot].copy_(b[slot])
    view, step = folded_b(w_aug, IN_DIM, c, MAX_RANK, len(RANKS))
    offsets = torch.tensor([0, Q, Q + KV, Q + 2 * KV], dtype=torch.int32) if c == 3 else None
    return xa, b, view, step, offsets, max(slice_sizes) if offsets is not None else None


@pytest.mark.parametrize("slice_sizes", [(PLAIN_OUT,), (INTER, INTER), (Q, KV, KV)])
def test_chunked_sgmv_expand_reads_a_folded_b_in_place(slice_sizes):
    """A folded module run apart at prefill (csgmv, SGLANG_LORA_PREFILL_UNFOLD): the expand reads
    B inside W_aug (fold.folded_b, slice k's rank columns k*R on) and adds exactly what it adds
    from a plain B."""
    from sglang.srt.lora.fold import fold_weight, folded_b

    num_slices, out_dim = len(slice_sizes), sum(slice_sizes)
    info, num_tokens = _csgmv_info(16, seed=11 * num_slices)
    xa, b, view, step, offsets, width = _folded_case(slice_sizes, info, num_tokens, seed=300 + num_slices)
    base = torch.full((num_tokens, out_dim), SENTINEL)
    plain = chunked_sgmv_lora_expand_forward(xa, b, info, base.clone(), num_slices, offsets, width)
    folded = chunked_sgmv_lora_expand_forward(xa, view, info, base.clone(), num_slices, offsets, width,
                                              slice_stride=step)
    assert torch.equal(plain, folded)
    _assert_untouched_rows(folded, info, num_tokens)


def test_chunked_sgmv_expand_reads_every_slots_shrink_and_b_transposed():
    """The A-fold's expand (csgmv, decode batches past SGLANG_LORA_AFOLD's bound): x is the GEMM's
    every-slot shrink [T, S*R] (row t's values at its slot's block, x_slot_stride = R), B the pool's
    transposed copy [S, R, N] seen as [S, N, R], and the base output a strided view of the same GEMM
    output: the same bits as the compact shrink and a plain B."""
    info, num_tokens = _csgmv_info(16, seed=13)
    gen = torch.Generator().manual_seed(400)
    xa = _poison_shrunk(_shrunk_input(num_tokens, 1, gen), info, 1)
    b = _poisoned_b(PLAIN_OUT, gen)
    every = torch.full((num_tokens, len(RANKS) * MAX_RANK), float("nan"))
    for rows, slot, r in _segments(info):
        every[rows, slot * MAX_RANK : slot * MAX_RANK + r] = xa[rows, :r]
    bt = b.transpose(1, 2).contiguous()  # [S, R, N], the pool's copy
    gemm_out = torch.full((num_tokens, PLAIN_OUT + every.shape[1]), SENTINEL)
    gemm_out[:, PLAIN_OUT:] = every
    plain = chunked_sgmv_lora_expand_forward(xa, b, info, torch.full((num_tokens, PLAIN_OUT), SENTINEL), 1)
    got = chunked_sgmv_lora_expand_forward(gemm_out[:, PLAIN_OUT:], bt.transpose(1, 2), info,
                                           gemm_out[:, :PLAIN_OUT], 1, x_slot_stride=MAX_RANK)
    assert got.data_ptr() == gemm_out.data_ptr()
    assert torch.equal(gemm_out[:, :PLAIN_OUT], plain)
    _assert_untouched_rows(gemm_out[:, :PLAIN_OUT], info, num_tokens)


@pytest.mark.parametrize("slice_sizes", [(INTER, INTER), (Q, KV, KV)])
def test_chunked_sgmv_expand_reads_a_many_slice_every_slot_shrink(slice_sizes):
    """The A-fold's shape for gate_up_proj / qkv_proj (benchmark/lora/bench_stacked_afold.py): x
    holds every slot's shrink, slot s's block [s*c*R, (s+1)*c*R) with its slices compact (slice k
    at k*r, as A's rows are), B read inside W_aug, the base output a strided view of the same GEMM
    output: the same bits as the compact shrink of each row's own slot."""
    c, out_dim = len(slice_sizes), sum(slice_sizes)
    info, num_tokens = _csgmv_info(16, seed=17 * c)
    xa, b, view, step, offsets, width = _folded_case(slice_sizes, info, num_tokens, seed=500 + c)
    block = c * MAX_RANK
    every = torch.full((num_tokens, len(RANKS) * block), float("nan"))
    for rows, slot, r in _segments(info):
        every[rows, slot * block : slot * block + c * r] = xa[rows, : c * r]
    gemm_out = torch.full((num_tokens, out_dim + every.shape[1]), SENTINEL)
    gemm_out[:, out_dim:] = every
    plain = chunked_sgmv_lora_expand_forward(xa, b, info, torch.full((num_tokens, out_dim), SENTINEL), c, offsets,
                                             width)
    got = chunked_sgmv_lora_expand_forward(gemm_out[:, out_dim:], view, info, gemm_out[:, :out_dim], c, offsets,
                                           width, slice_stride=step, x_slot_stride=block)
    assert got.data_ptr() == gemm_out.data_ptr()
    assert torch.equal(gemm_out[:, :out_dim], plain)
    _assert_untouched_rows(gemm_out[:, :out_dim], info, num_tokens)


def test_all_rank_zero_is_a_noop():
    """The capture-time state of every static info: kernels launch, nothing changes."""
    gen = torch.Generator().manual_seed(3)
    info, num_tokens = _csgmv_info(16, seed=3)
    info.lora_ranks = torch.zeros_like(info.lora_ranks)
    x = torch.randn(num_tokens, IN_DIM, generator=gen)
    out = _shrink_output(num_tokens, 3)
    chunked_sgmv_lora_shrink_forward(x, _poisoned_a(3, gen), info, 3, out=out)
    assert torch.equal(out, _shrink_output(num_tokens, 3))
    base = torch.randn(num_tokens, Q + 2 * KV, generator=gen)
    before = base.clone()
    offsets = torch.tensor([0, Q, Q + KV, Q + 2 * KV], dtype=torch.int32)
    nan_xa = torch.full((num_tokens, 3 * MAX_RANK), float("nan"))
    chunked_sgmv_lora_expand_forward(nan_xa, _poisoned_b(Q + 2 * KV, gen), info, base, 3, offsets, Q)
    assert torch.equal(base, before)


@pytest.mark.parametrize("programs_per_segment", [1, 2])
def test_token_lanes_walk_whole_chunks(monkeypatch, programs_per_segment):
    """With fewer lanes than token tiles, each lane loops over its tiles (a chunk of 128 tokens
    walked by one or two lanes of 16-row shrink tiles / 64-row expand tiles)."""
    from sglang.srt.lora.triton_ops import _tiles

    monkeypatch.setattr(_tiles, "PROGRAMS_PER_SEGMENT", programs_per_segment)
    gen = torch.Generator().manual_seed(31)
    rows = 150 + 7 + 33 + 2
    perm = torch.randperm(rows, generator=gen)
    info = _make_info([128, 22, 7, 33], [2, 2, 0, 3], max_len=128, perm=perm)
    x = torch.randn(rows, IN_DIM, generator=gen)
    a = _poisoned_a(3, gen)
    out = _shrink_output(rows, 3)
    chunked_sgmv_lora_shrink_forward(x, a, info, 3, out=out)
    torch.testing.assert_close(out, ref_shrink(x, a, info, 3, _shrink_output(rows, 3)), rtol=1e-5, atol=1e-5)

    xa = _poison_shrunk(_shrunk_input(rows, 3, gen), info, 3)
    b = _poisoned_b(Q + 2 * KV, gen)
    base = torch.full((rows, Q + 2 * KV), SENTINEL)
    bounds = [(0, Q), (Q, Q + KV), (Q + KV, Q + 2 * KV)]
    expected = ref_expand(xa, b, info, base, bounds)
    offsets = torch.tensor([0, Q, Q + KV, Q + 2 * KV], dtype=torch.int32)
    got = chunked_sgmv_lora_expand_forward(xa, b, info, base, 3, offsets, max(Q, KV))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    _assert_untouched_rows(got, info, rows)


@pytest.mark.parametrize("block_n", [16, 32])
def test_expand_tile_plans_give_the_same_bits(block_n):
    """The tile plan (BLOCK_N, warps) changes which program computes an element, never its sum: other
    warp counts give the same bits as the plan of the same width, masked past each slice (16-wide
    tiles split q's 32 columns, kv is narrower than q), nothing outside the segments touched.
    (Another tile width may round otherwise in the interpreter's float32 matmul.)"""
    from sglang.srt.lora.triton_ops.sgemm_lora_b import segmented_expand

    info, num_tokens = _csgmv_info(16, seed=11)
    gen = torch.Generator().manual_seed(211)
    xa = _poison_shrunk(_shrunk_input(num_tokens, 3, gen), info, 3)
    b = _poisoned_b(Q + 2 * KV, gen)
    offsets = torch.tensor([0, Q, Q + KV, Q + 2 * KV], dtype=torch.int32)
    bounds = [(0, Q), (Q, Q + KV), (Q + KV, Q + 2 * KV)]
    expected = ref_expand(xa, b, info, torch.full((num_tokens, Q + 2 * KV), SENTINEL), bounds)

    def run(tiles):
        base = torch.full((num_tokens, Q + 2 * KV), SENTINEL)
        return segmented_expand(xa, b, info, base, 3, offsets, max(Q, KV), tiles=tiles)

    one = run((block_n, 4))
    torch.testing.assert_close(one, expected, rtol=1e-5, atol=1e-4)
    # "b-early": B's first rank block loaded with the rank and rows, zeroed past the rank after.
    for tiles in [(block_n, 2), (block_n, 8), (block_n, 4, "b-early"), (block_n, 8, "b-early")]:
        got = run(tiles)
        assert torch.equal(got, one), tiles
        _assert_untouched_rows(got, info, num_tokens)


@triton.jit
def _no_wait():
    """The grid dependency wait's stand-in under the interpreter (which has no such control)."""
    pass


def test_expand_as_a_dependent_gives_the_same_bits(monkeypatch):
    """Launched as a programmatic dependent (sgemm_lora_b.PDL_MAX_ROWS) the expand's empty segment,
    rank-0 segments and kv's spare column tiles reach the wait and leave after it, B's first block
    masked for them: the same bits as the plain launch, nothing outside the segments touched. (The
    interpreter has no grid dependency control: the wait is a no-op here; the GPU test and the PTX
    check cover the launch itself.)"""
    from sglang.srt.lora.triton_ops import sgemm_lora_b

    monkeypatch.setattr(sgemm_lora_b, "gdc_wait", _no_wait)
    monkeypatch.setattr(sgemm_lora_b, "PDL_MAX_ROWS", 1 << 20)
    info, num_tokens = _csgmv_info(16, seed=11)
    gen = torch.Generator().manual_seed(211)
    xa = _poison_shrunk(_shrunk_input(num_tokens, 3, gen), info, 3)
    b = _poisoned_b(Q + 2 * KV, gen)
    offsets = torch.tensor([0, Q, Q + KV, Q + 2 * KV], dtype=torch.int32)

    def run(use_pdl: bool) -> torch.Tensor:
        base = torch.full((num_tokens, Q + 2 * KV), SENTINEL)
        return sgemm_lora_b.segmented_expand(xa, b, info, base, 3, offsets, max(Q, KV), use_pdl=use_pdl)

    plain, dependent = run(False), run(True)
    assert torch.equal(dependent, plain)
    _assert_untouched_rows(dependent, info, num_tokens)
