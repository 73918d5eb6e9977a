"""Adapter segments of a batch: the row order and the runs that every token-major LoRA kernel walks.

Once per forward, on the host, the batch's token rows are put in this order (`permutation[p]` is
the row at position p):

    positions [0, A)          rows of active adapters (slot rank > 0), grouped by slot in ascending
                              slot order, each group in row order (a stable sort: the tokens of a
                              prefill request stay contiguous);
    positions [A, num_rows)   every other row in row order: base-model rows, rows of rank-0 slots,
                              and the padding rows of a graph bucket.

Each group, and the inactive run, is cut into *segments* of at most `chunk` positions; segment i
covers positions [seg_indptr[i], seg_indptr[i+1]) and names its slot in weight_indices[i] (the
inactive run names `idle_slot`, a slot of rank 0). Every row is in exactly one segment and every
segment has one slot, so a kernel program works on one adapter's weights whatever the batch
interleaves: a decode batch of 64 requests on 8 adapters costs the 8 adapters' bytes once per
module, not 8 masked reductions per 16-row tile (the old token-major kernels' cost).

Capacity. The segments of n rows in k active groups number at most sum ceil(g/chunk) +
ceil(inactive/chunk) < n/chunk + k + 1, so `segment_capacity(n)` = cdiv(n, chunk) +
min(num_slots, n) + 1 bounds them. A graph captured for a bucket of B rows launches
segment_capacity(B) segment programs; the static metadata covers all of its rows (the inactive
run continues through the padding rows in row order), so the first segment_capacity(B) segments
hold every row < B of any live batch replayed on it. Rows >= B in those segments are masked by the
kernels' row bound. Unused segments are empty (start == end).

The order and the segments depend on the live batch only, never on the bucket or on which path
runs it, and each row's sums depend on the kernels' static tile plan only: a graph replay and an
eager pass compute every row bit for bit alike.
"""

from __future__ import annotations

from array import array
from collections import Counter
from dataclasses import dataclass
from typing import Optional, Sequence

import torch


def segment_capacity(num_rows: int, chunk: int, num_slots: int) -> int:
    """Most segments `num_rows` rows can take (see the module docstring)."""
    return -(-num_rows // chunk) + min(num_slots, num_rows) + 1


@dataclass
class Segments:
    """Host-side result of ordering and cutting one batch."""

    permutation: torch.Tensor  # int32 [num_rows]: position -> token row
    seg_indptr: list[int]  # [num_segments + 1]
    weight_indices: list[int]  # [num_segments]
    num_active_rows: int  # positions [0, A) hold rows of active adapters

    @property
    def num_segments(self) -> int:
        return len(self.weight_indices)


def _cut(groups: Sequence[tuple[int, int]], chunk: int) -> tuple[list[int], list[int]]:
    """Segments of consecutive (slot, size) groups: CSR offsets and a slot per segment."""
    indptr, slots = [0], []
    for slot, size in groups:
        start = indptr[-1]
        indptr.extend(range(start + chunk, start + size, chunk))
        indptr.append(start + size)
        slots.extend([slot] * (-(-size // chunk)))
    return indptr, slots


def int32_tensor(values: Sequence[int]) -> torch.Tensor:
    """A CPU int32 tensor of host ints (through array: several times faster than torch.tensor(list))."""
    return torch.frombuffer(array("i", values), dtype=torch.int32) if len(values) else torch.empty(0, dtype=torch.int32)


def build_segments(
    req_slots: Sequence[int],
    req_lens: Sequence[int],
    slot_ranks: Sequence[int],
    chunk: int,
    num_rows: int,
    idle_slot: int,
    one_row_each: Optional[bool] = None,
) -> Segments:
    """Order the rows of requests (slot, token count) by active slot and cut them into segments.

    Requests cover rows [0, sum(req_lens)) in order; rows past them up to `num_rows` are padding.
    A slot of -1 or of rank 0 is inactive. Requests with no tokens take no row. Runs once per
    forward on the host, so the decode case (one row per request) stays in plain Python lists;
    `one_row_each` True says so up front (a decode batch), None looks at the lengths.
    """
    inactive_key = len(slot_ranks)
    keys = [s if s >= 0 and slot_ranks[s] > 0 else inactive_key for s in req_slots]
    order = sorted(range(len(keys)), key=keys.__getitem__)  # stable
    if one_row_each is None:
        one_row_each = all(n == 1 for n in req_lens)
    live = len(keys) if one_row_each else sum(req_lens)
    assert live <= num_rows, (live, num_rows)
    if one_row_each:
        sizes = Counter(keys)
        permutation = int32_tensor(order + list(range(live, num_rows)))
    else:
        sizes = Counter()
        for k, n in zip(keys, req_lens):
            sizes[k] += n
        if order == sorted(order):
            permutation = torch.arange(num_rows, dtype=torch.int32)
        else:
            lens = torch.tensor(req_lens, dtype=torch.int64)
            starts = torch.cumsum(lens, 0) - lens
            idx = torch.tensor(order, dtype=torch.int64)
            lens_sorted = lens[idx]
            first = torch.cumsum(lens_sorted, 0) - lens_sorted  # position of each request's first row
            permutation = torch.repeat_interleave(starts[idx] - first, lens_sorted) + torch.arange(live)
            permutation = torch.cat([permutation, torch.arange(live, num_rows)]).to(torch.int32)
    active_groups = [(k, sizes[k]) for k in sorted(sizes) if k != inactive_key and sizes[k] > 0]
    num_active = sum(size for _, size in active_groups)
    inactive_rows = num_rows - num_active
    indptr, slots = _cut(active_groups + ([(idle_slot, inactive_rows)] if inactive_rows else []), chunk)
    return Segments(permutation, indptr, slots, num_active)


def idle_slot_of(slot_ranks: Sequence[int]) -> int:
    """A slot of rank 0 for the inactive run (the pool always has one: the base model's); -1 if none
    (the token-major kernels read -1 as rank 0)."""
    return next((s for s, r in enumerate(slot_ranks) if r == 0), -1)
