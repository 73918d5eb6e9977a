"""Token-major LoRA kernels (token_shrink / token_expand) vs a torch reference (CPU interpreter, fp32).

Same poisoning as test_lora_kernels.py: NaN past each adapter's compact prefix in A and B and past
its columns in the shrink output, sentinels in rows that must stay untouched (base rows, padding).
Layouts cover one slot per tile (the fast path), several slots in one tile (the slot loop), rank-0
rows between adapter rows, padding (slot -1), and split-K with its counters re-armed to zero.
"""

from __future__ import annotations

import pytest
import torch

from sglang.srt.lora.triton_ops.token_lora import (
    ExpandPlan,
    plan_expand,
    plan_shrink,
    token_expand,
    token_shrink,
)
from test_lora_kernels import (  # noqa: E402 (conftest puts this directory on sys.path)
    IN_DIM,
    KV,
    MAX_RANK,
    PLAIN_OUT,
    Q,
    RANKS,
    SCALINGS,
    SENTINEL,
    INTER,
    _poisoned_a,
    _poisoned_b,
)

RANKS_T = torch.tensor(RANKS, dtype=torch.int32)
SCALINGS_T = torch.tensor(SCALINGS, dtype=torch.float32)

# Per-request (length, slot) then padding rows (slot -1).
LAYOUTS = {
    # one request per tile region, an empty request, a rank-0 request, uneven lengths
    "mixed": ([5, 0, 9, 3, 4], [1, 2, 0, 3, 2], 3),
    # 40 rows of one adapter: whole tiles of one slot (fast path), then a partial tile
    "long": ([40, 1, 7], [2, 3, 1], 2),
    # decode: every row its own request, slots interleaved within one tile
    "decode": ([1] * 7, [1, 0, 2, 3, 2, 1, 3], 0),
}


def _token_slots(name: str) -> tuple[torch.Tensor, int]:
    lens, slots, pad = LAYOUTS[name]
    per_row = [s for n, s in zip(lens, slots) for _ in range(n)] + [-1] * pad
    return torch.tensor(per_row, dtype=torch.int32), len(per_row)


def _rows_of(token_slots: torch.Tensor):
    """(row, slot, rank) of every row with an active slot."""
    for row, slot in enumerate(token_slots.tolist()):
        if slot >= 0 and RANKS[slot] > 0:
            yield row, slot, RANKS[slot]


def ref_shrink(x, a, token_slots, stack, out):
    out = out.clone()
    for row, slot, r in _rows_of(token_slots):
        out[row, : stack * r] = x[row] @ a[slot, : stack * r].T
    return out


def ref_expand(xa, b, token_slots, base, bounds):
    base = base.clone()
    for row, slot, r in _rows_of(token_slots):
        for k, (lo, hi) in enumerate(bounds):
            base[row, lo:hi] += SCALINGS[slot] * (xa[row, k * r : (k + 1) * r] @ b[slot, lo:hi, :r].T)
    return base


def _assert_untouched(out: torch.Tensor, token_slots: torch.Tensor) -> None:
    touched = torch.zeros(out.shape[0], dtype=torch.bool)
    for row, _, _ in _rows_of(token_slots):
        touched[row] = True
    assert (~touched).any(), "layout must leave some rows untouched"
    assert torch.equal(out[~touched], torch.full_like(out[~touched], SENTINEL))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("stack", [1, 2, 3])
def test_token_shrink(layout, stack):
    gen = torch.Generator().manual_seed(stack)
    token_slots, rows = _token_slots(layout)
    x = torch.randn(rows, IN_DIM, generator=gen)
    a = _poisoned_a(stack, gen)
    out = torch.full((rows, stack * MAX_RANK), SENTINEL)
    got = token_shrink(x, a, token_slots, RANKS_T, stack, out=out)
    assert got.data_ptr() == out.data_ptr()
    expected = ref_shrink(x, a, token_slots, stack, torch.full((rows, stack * MAX_RANK), SENTINEL))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["mixed", "decode"])
@pytest.mark.parametrize("split", [2, 3])
def test_token_shrink_split_k_rearms_its_counters(layout, split):
    """Partial sums meet in the last program of each tile; counters are back at 0 afterwards, so
    a second launch (as a graph replay would do) gives the same result bit for bit."""
    gen = torch.Generator().manual_seed(40 + split)
    token_slots, rows = _token_slots(layout)
    in_dim = 300  # 3 K tiles of 128 (fp32), the last one partial
    x = torch.randn(rows, in_dim, generator=gen)
    a = torch.randn(len(RANKS), 2 * MAX_RANK, in_dim, generator=gen)
    for slot, r in enumerate(RANKS):
        a[slot, 2 * r :] = float("nan")
    plan = plan_shrink(rows, in_dim, 2 * MAX_RANK, x.element_size())
    k_per_split = -(-in_dim // (split * plan.block_k)) * plan.block_k
    plan = type(plan)(**{**plan.__dict__, "split": -(-in_dim // k_per_split), "k_per_split": k_per_split})
    assert plan.split == split
    workspace = torch.full((plan.workspace_numel,), float("nan"))
    counters = torch.zeros(plan.num_counters, dtype=torch.int32)
    outs = []
    for _ in range(2):
        out = torch.full((rows, 2 * MAX_RANK), SENTINEL)
        token_shrink(x, a, token_slots, RANKS_T, 2, out=out, workspace=workspace, counters=counters, plan=plan)
        assert torch.equal(counters, torch.zeros_like(counters))
        outs.append(out)
    expected = ref_shrink(x, a, token_slots, 2, torch.full((rows, 2 * MAX_RANK), SENTINEL))
    torch.testing.assert_close(outs[0], expected, rtol=1e-5, atol=1e-4)
    assert torch.equal(outs[0], outs[1])


def test_plan_shrink_splits_only_short_batches():
    decode = plan_shrink(1, 14336, 16, 2)
    assert decode.split > 1 and decode.grid[0] <= 256 and decode.k_per_split % decode.block_k == 0
    long = plan_shrink(2048, 4096, 48, 2)
    assert long.block_s == 64 and long.split < decode.split
    assert plan_shrink(8, 40, 16, 4).split == 1  # a single K tile cannot be split


def _shrunk(rows: int, stack: int, token_slots: torch.Tensor, gen) -> torch.Tensor:
    xa = torch.randn(rows, stack * MAX_RANK, generator=gen)
    for row, slot, r in _rows_of(token_slots):
        xa[row, stack * r :] = float("nan")
    return xa


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_token_expand_plain(layout):
    gen = torch.Generator().manual_seed(11)
    token_slots, rows = _token_slots(layout)
    xa = _shrunk(rows, 1, token_slots, gen)
    b = _poisoned_b(PLAIN_OUT, gen)
    base = torch.full((rows, PLAIN_OUT), SENTINEL)
    expected = ref_expand(xa, b, token_slots, base, [(0, PLAIN_OUT)])
    got = token_expand(xa, b, token_slots, RANKS_T, SCALINGS_T, base, 1)
    assert got.data_ptr() == base.data_ptr()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    _assert_untouched(got, token_slots)


@pytest.mark.parametrize("layout", ["mixed", "decode"])
def test_token_expand_qkv_gqa_and_gate_up(layout):
    gen = torch.Generator().manual_seed(5)
    token_slots, rows = _token_slots(layout)
    xa = _shrunk(rows, 3, token_slots, gen)
    b = _poisoned_b(Q + 2 * KV, gen)
    offsets = torch.tensor([0, Q, Q + KV, Q + 2 * KV], dtype=torch.int32)
    base = torch.full((rows, Q + 2 * KV), SENTINEL)
    bounds = [(0, Q), (Q, Q + KV), (Q + KV, Q + 2 * KV)]
    expected = ref_expand(xa, b, token_slots, base, bounds)
    got = token_expand(xa, b, token_slots, RANKS_T, SCALINGS_T, base, 3, offsets, max(Q, KV))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    _assert_untouched(got, token_slots)

    xa2 = _shrunk(rows, 2, token_slots, gen)
    b2 = _poisoned_b(2 * INTER, gen)
    base2 = torch.full((rows, 2 * INTER), SENTINEL)
    expected2 = ref_expand(xa2, b2, token_slots, base2, [(0, INTER), (INTER, 2 * INTER)])
    got2 = token_expand(xa2, b2, token_slots, RANKS_T, SCALINGS_T, base2, 2)
    torch.testing.assert_close(got2, expected2, rtol=1e-5, atol=1e-4)


def test_token_expand_bucket_sized_grid_with_padding():
    """A graph's grid is sized for the bucket: tiles of padding rows (slot -1) must do nothing."""
    gen = torch.Generator().manual_seed(9)
    live = torch.tensor([2] * 20 + [1] * 30 + [0] * 5, dtype=torch.int32)
    token_slots = torch.cat([live, torch.full((73,), -1, dtype=torch.int32)])  # 128-row bucket
    rows = token_slots.numel()
    xa = _shrunk(rows, 1, token_slots, gen)
    b = _poisoned_b(PLAIN_OUT, gen)
    base = torch.full((rows, PLAIN_OUT), SENTINEL)
    plan = plan_expand(rows, PLAIN_OUT, 1, MAX_RANK)
    assert isinstance(plan, ExpandPlan) and plan.block_s == 64
    expected = ref_expand(xa, b, token_slots, base, [(0, PLAIN_OUT)])
    got = token_expand(xa, b, token_slots, RANKS_T, SCALINGS_T, base, 1, plan=plan)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    _assert_untouched(got, token_slots)


def test_shrink_then_expand_matches_dense_lora():
    gen = torch.Generator().manual_seed(8)
    token_slots, rows = _token_slots("mixed")
    x = torch.randn(rows, IN_DIM, generator=gen)
    a = _poisoned_a(1, gen)
    b = _poisoned_b(PLAIN_OUT, gen)
    base = torch.randn(rows, PLAIN_OUT, generator=gen)
    expected = base.clone()
    for row, slot, r in _rows_of(token_slots):
        expected[row] += SCALINGS[slot] * (x[row] @ a[slot, :r].T @ b[slot, :, :r].T)
    xa = token_shrink(x, a, token_slots, RANKS_T, 1)
    got = token_expand(xa, b, token_slots, RANKS_T, SCALINGS_T, base.clone(), 1)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
