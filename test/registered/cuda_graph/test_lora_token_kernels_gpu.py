"""Token-major LoRA kernels on the GPU (Llama-8B shapes, bf16): the unfolded pair (shrink + expand)
and the folded module's shrink_pack.

  - the bound launch path and PDL give the ordinary launch's bits; split-K counters are re-armed;
  - fp32 reference within bf16 rounding;
  - a CUDA graph captured on a 512-row bucket (grid: the bucket's segment capacity) and replayed
    for several live batches (segments refreshed in place, padding rows under a rank-0 slot) gives,
    on every live row, the bits of an EAGER run on the live rows and their own segments only: the
    plans do not depend on the batch (graph == eager, bit for bit).
"""

from __future__ import annotations

import pytest
import torch

from sglang.srt.lora.fold import fold_extra_columns
from sglang.srt.lora.segments import build_segments, idle_slot_of, segment_capacity
from sglang.srt.lora.triton_ops.token_lora import (
    SEGMENT_ROWS,
    plan_expand,
    plan_pack,
    plan_shrink,
    prepare_expand,
    prepare_pack,
    prepare_shrink,
)

pytestmark = pytest.mark.gpu

H, Q, KV, INTER, R, SLOTS = 4096, 4096, 1024, 14336, 16, 4
DTYPE = torch.bfloat16
RANKS = [0, 16, 8, 16]
SCALINGS = [0.0, 2.0, 0.5, 1.0]
# (module, in_dim, stack, slices)
MODULES = [
    ("qkv", H, 3, [(0, Q), (Q, Q + KV), (Q + KV, Q + 2 * KV)]),
    ("gate_up", H, 2, [(0, INTER), (INTER, 2 * INTER)]),
    ("down", INTER, 1, [(0, H)]),
]


def _weights(gen):
    w = {}
    for name, in_dim, c, slices in MODULES:
        a = torch.randn(SLOTS, c * R, in_dim, generator=gen, device="cuda") / in_dim**0.5
        b = torch.randn(SLOTS, slices[-1][1], R, generator=gen, device="cuda") / R**0.5
        for s, r in enumerate(RANKS):  # the pool keeps everything past an adapter's prefix at zero
            a[s, c * r :] = 0
            b[s, :, r:] = 0
        w[name] = (a.to(DTYPE), b.to(DTYPE))
    return w


def _segments(lens, slots, rows: int, capacity: int = 0) -> list[torch.Tensor]:
    """(perm, seg_indptr, weight_indices) of a batch over `rows` rows, padded to `capacity`
    segments with empty ones (0: exactly the batch's segments)."""
    idle = idle_slot_of(RANKS)
    segs = build_segments(slots, lens, RANKS, SEGMENT_ROWS, rows, idle)
    pad = max(capacity - segs.num_segments, 0)
    as_i32 = lambda v: torch.tensor(v, dtype=torch.int32, device="cuda")  # noqa: E731
    return [segs.permutation.cuda(), as_i32(segs.seg_indptr + [segs.seg_indptr[-1]] * pad),
            as_i32(segs.weight_indices + [idle] * pad)]


class Runner:
    """Every launch of one batch prepared once, as the backend does. `fold`: the modules'
    shrink_pack (writing x_aug) instead of shrink + expand (adding into outs). The segment tensors
    are static: `load` refreshes them in place (a graph's capacity) or sizes them (eager)."""

    def __init__(self, rows: int, num_segments: int, w, use_pdl: bool, fold: bool = False, bound: bool = True):
        self.rows, self.num_segments = rows, num_segments
        self.segs = _segments([], [], rows, num_segments)
        self.ranks = torch.tensor(RANKS, dtype=torch.int32, device="cuda")
        self.scalings = torch.tensor(SCALINGS, dtype=torch.float32, device="cuda")
        self.offsets = torch.tensor([0, Q, Q + KV, Q + 2 * KV], dtype=torch.int32, device="cuda")
        self.w, self.bound, self.fold, self.launches = w, bound, fold, {}
        ws = cnt = 1
        for name, in_dim, c, slices in MODULES:
            a, b = w[name]
            sp = plan_shrink(in_dim, c * R, a.element_size())
            ws, cnt = max(ws, sp.workspace_numel(rows)), max(cnt, sp.num_counters(num_segments))
            x_like = torch.empty(0, in_dim, dtype=DTYPE, device="cuda")
            if fold:
                extra = fold_extra_columns(SLOTS, c, R)
                x_aug = torch.empty(rows, in_dim + extra, dtype=DTYPE, device="cuda")
                plan = plan_pack(in_dim, c, R, extra, a.element_size())
                pack = prepare_pack(plan, rows, num_segments, x_like, a, in_dim + extra, use_pdl)
                self.launches[name] = (pack, x_aug)
                continue
            widths = {hi - lo for lo, hi in slices}
            ep = plan_expand(b.shape[1], len(slices), R, None if len(widths) == 1 else max(widths))
            xa = torch.empty(rows, c * R, dtype=DTYPE, device="cuda")
            self.launches[name] = (
                prepare_shrink(sp, rows, num_segments, x_like, a, c * R, c, use_pdl),
                prepare_expand(ep, rows, num_segments, b, c * R, b.shape[1], len(widths) > 1, use_pdl),
                xa,
            )
        self.workspace = torch.empty(ws, dtype=torch.float32, device="cuda")
        self.counters = torch.zeros(cnt, dtype=torch.int32, device="cuda")

    def load(self, lens, slots) -> None:
        for dst, src in zip(self.segs, _segments(lens, slots, self.rows, self.num_segments)):
            assert dst.numel() == src.numel()
            dst.copy_(src)

    @staticmethod
    def eager(lens, slots, w, use_pdl: bool, fold: bool = False, bound: bool = True) -> "Runner":
        """A runner for exactly this batch's rows and segments."""
        rows = sum(lens)
        runner = Runner(rows, len(_segments(lens, slots, rows)[2]), w, use_pdl, fold, bound)
        runner.load(lens, slots)
        return runner

    def run(self, inputs: dict, outs: dict) -> None:
        """Unfolded: outs[name] += LoRA. Folded: outs[name] <- x_aug."""
        for name, *_ in MODULES:
            a, b = self.w[name]
            meta = (*self.segs, self.ranks)
            if self.fold:
                pack, x_aug = self.launches[name]
                pack = pack if self.bound else pack.call_unbound
                pack(inputs[name], a, x_aug, self.workspace, self.counters, *meta, self.scalings)
                outs[name] = x_aug
                continue
            shrink, expand, xa = self.launches[name]
            if not self.bound:
                shrink, expand = shrink.call_unbound, expand.call_unbound
            shrink(inputs[name], a, xa, self.workspace, self.counters, *meta)
            offsets = self.offsets if name == "qkv" else self.counters  # unused without offsets
            expand(xa, b, outs[name], *meta, self.scalings, offsets)


def _io(rows: int, gen):
    inputs = {n: torch.randn(rows, d, generator=gen, device="cuda").to(DTYPE) for n, d, _, _ in MODULES}
    outs = {n: torch.randn(rows, s[-1][1], generator=gen, device="cuda").to(DTYPE) for n, _, _, s in MODULES}
    return inputs, outs


def _slots(lens, slots, rows):
    per_row = [s for n, s in zip(lens, slots) for _ in range(n)]
    return torch.tensor(per_row + [-1] * (rows - len(per_row)), dtype=torch.int32, device="cuda")


def _reference_delta(name, in_dim, c, slices, w, x, token_slots) -> torch.Tensor:
    a, b = (t.float() for t in w[name])
    delta = torch.zeros(x.shape[0], slices[-1][1], device="cuda")
    for row, s in enumerate(token_slots):
        r = RANKS[s] if s >= 0 else 0
        if r:
            xa = x[row].float() @ a[s, : c * r].T
            for k, (lo, hi) in enumerate(slices):
                delta[row, lo:hi] = SCALINGS[s] * (xa[k * r : (k + 1) * r] @ b[s, lo:hi, :r].T)
    return delta


def _folded_delta(name, c, slices, w, x_aug, in_dim) -> torch.Tensor:
    """x_aug's extra columns times the block-diagonal B (what the folded GEMM adds)."""
    _, b = w[name]
    extra = x_aug[:, in_dim:].float()
    delta = torch.zeros(x_aug.shape[0], slices[-1][1], device="cuda")
    for s in range(SLOTS):
        for k, (lo, hi) in enumerate(slices):
            col = s * c * R + k * R
            delta[:, lo:hi] += extra[:, col : col + R] @ b[s, lo:hi].float().T
    return delta


CASES = [(1, [1], [1]), (16, [1] * 16, [i % 4 for i in range(16)]), (300, [37, 200, 5, 58], [1, 0, 2, 3])]


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("rows,lens,slots", CASES)
def test_parity_bound_and_pdl(rows, lens, slots, fold):
    gen = torch.Generator(device="cuda").manual_seed(rows)
    w = _weights(gen)
    inputs, outs = _io(rows, gen)
    results = {}
    for key, kwargs in {"plain": dict(use_pdl=False, bound=False), "bound": dict(use_pdl=False),
                        "pdl": dict(use_pdl=True)}.items():
        runner = Runner.eager(lens, slots, w, fold=fold, **kwargs)
        got = {k: v.clone() for k, v in outs.items()}
        runner.run(inputs, got)
        got = {k: v.clone() for k, v in got.items()}
        runner.run(inputs, {k: v.clone() for k, v in outs.items()})  # second call: the fast path
        assert torch.equal(runner.counters, torch.zeros_like(runner.counters))
        if key != "plain":
            assert runner.launches["qkv"][0].bound.fast_launches > 0
        results[key] = got
    for key in ("bound", "pdl"):
        for name in results["plain"]:
            assert torch.equal(results[key][name], results["plain"][name]), (key, name)
    token_slots = _slots(lens, slots, rows).tolist()
    for name, in_dim, c, slices in MODULES:
        ref = _reference_delta(name, in_dim, c, slices, w, inputs[name], token_slots)
        if fold:
            x_aug = results["plain"][name]
            assert torch.equal(x_aug[:, :in_dim], inputs[name])
            delta = _folded_delta(name, c, slices, w, x_aug, in_dim)
        else:
            delta = results["plain"][name].float() - outs[name].float()
        assert (delta - ref).norm() / ref.norm() < 2e-2, name


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("use_pdl", [False, True])
def test_graph_replay_matches_eager_on_live_rows(use_pdl, fold):
    bucket = 512
    gen = torch.Generator(device="cuda").manual_seed(7)
    w = _weights(gen)
    graph_runner = Runner(bucket, segment_capacity(bucket, SEGMENT_ROWS, SLOTS), w, use_pdl, fold)
    graph_runner.load([], [])  # all rows inactive, as at capture
    static_in, static_out = _io(bucket, gen)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph_runner.run(static_in, static_out)  # compile on the capture stream, all rows -1
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_runner.run(static_in, static_out)
    batches = [([100, 300, 50, 62], [1, 2, 3, 1]), ([7] * 40, [i % 4 for i in range(40)]), ([3], [2]), ([9, 9], [0, 0])]
    for lens, slots in batches:
        live = sum(lens)
        inputs, outs = _io(live, gen)
        for k in inputs:
            static_in[k][:live].copy_(inputs[k])
            if not fold:
                static_out[k][:live].copy_(outs[k])
        graph_runner.load(lens, slots)
        graph.replay()
        eager = Runner.eager(lens, slots, w, use_pdl, fold)  # its own grid, for the live rows only
        expected = {k: v.clone() for k, v in outs.items()}
        eager.run(inputs, expected)
        for k in static_out:
            assert torch.equal(static_out[k][:live], expected[k]), (lens, k)
        if fold:  # padding rows: x copied, nothing packed
            for name, in_dim, *_ in MODULES:
                assert torch.count_nonzero(static_out[name][live:, in_dim:]) == 0, name
