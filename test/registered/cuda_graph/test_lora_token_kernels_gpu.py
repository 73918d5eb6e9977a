"""Token-major LoRA kernels on the GPU: bf16 parity at Llama-8B shapes, the bound launch path and
PDL against the ordinary launch bit for bit, and a CUDA graph replayed for several live batches
(token slots refreshed in place, padding rows at -1) against eager bit for bit."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.lora.triton_ops.token_lora import plan_expand, plan_shrink, prepare_expand, prepare_shrink

pytestmark = pytest.mark.gpu

H, Q, KV, INTER, R, SLOTS = 4096, 4096, 1024, 14336, 16, 4
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
        w[name] = (a.bfloat16(), b.bfloat16())
    return w


class Runner:
    """Every launch of one row count prepared once, as a backend does per batch."""

    def __init__(self, rows: int, w, use_pdl: bool, bound: bool = True):
        self.token_slots = torch.full((rows,), -1, dtype=torch.int32, device="cuda")
        self.ranks = torch.tensor(RANKS, dtype=torch.int32, device="cuda")
        self.scalings = torch.tensor(SCALINGS, dtype=torch.float32, device="cuda")
        self.offsets = torch.tensor([0, Q, Q + KV, Q + 2 * KV], dtype=torch.int32, device="cuda")
        self.w, self.bound, self.launches = w, bound, {}
        ws = cnt = 1
        for name, in_dim, c, slices in MODULES:
            a, b = w[name]
            sp = plan_shrink(rows, in_dim, c * R, 2)
            ws, cnt = max(ws, sp.workspace_numel), max(cnt, sp.num_counters)
            widths = {hi - lo for lo, hi in slices}
            ep = plan_expand(rows, b.shape[1], len(slices), R, None if len(widths) == 1 else max(widths))
            xa = torch.empty(rows, c * R, dtype=torch.bfloat16, device="cuda")
            x_like = torch.empty(0, in_dim, dtype=torch.bfloat16, device="cuda")
            self.launches[name] = (
                prepare_shrink(sp, x_like, a, c * R, c, use_pdl),
                prepare_expand(ep, b, c * R, b.shape[1], len(widths) > 1, use_pdl),
                xa,
            )
        self.workspace = torch.empty(ws, dtype=torch.float32, device="cuda")
        self.counters = torch.zeros(cnt, dtype=torch.int32, device="cuda")

    def run(self, inputs: dict, outs: dict) -> None:
        for name, *_ in MODULES:
            shrink, expand, xa = self.launches[name]
            if not self.bound:
                shrink, expand = shrink.call_unbound, expand.call_unbound
            a, b = self.w[name]
            shrink(inputs[name], a, xa, self.workspace, self.counters, self.token_slots, self.ranks)
            offsets = self.offsets if name == "qkv" else self.token_slots
            expand(xa, b, outs[name], self.token_slots, self.ranks, self.scalings, offsets)


def _io(rows: int, gen):
    inputs = {n: torch.randn(rows, d, generator=gen, device="cuda").bfloat16() for n, d, _, _ in MODULES}
    outs = {n: torch.randn(rows, s[-1][1], generator=gen, device="cuda").bfloat16() for n, _, _, s in MODULES}
    return inputs, outs


def _slots(lens, slots, rows):
    per_row = [s for n, s in zip(lens, slots) for _ in range(n)]
    return torch.tensor(per_row + [-1] * (rows - len(per_row)), dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("rows,lens,slots", [(1, [1], [1]), (16, [1] * 16, [i % 4 for i in range(16)]),
                                             (300, [37, 200, 5, 58], [1, 0, 2, 3])])
def test_parity_bound_and_pdl(rows, lens, slots):
    gen = torch.Generator(device="cuda").manual_seed(rows)
    w = _weights(gen)
    inputs, outs = _io(rows, gen)
    results = {}
    for key, kwargs in {"plain": dict(use_pdl=False, bound=False), "bound": dict(use_pdl=False),
                        "pdl": dict(use_pdl=True)}.items():
        runner = Runner(rows, w, **kwargs)
        runner.token_slots.copy_(_slots(lens, slots, rows))
        got = {k: v.clone() for k, v in outs.items()}
        runner.run(inputs, got)
        runner.run(inputs, {k: v.clone() for k, v in outs.items()})  # second call: the fast path
        assert torch.equal(runner.counters, torch.zeros_like(runner.counters))
        if key != "plain":
            assert runner.launches["qkv"][0].bound.fast_launches > 0
        results[key] = got
    for key in ("bound", "pdl"):
        for name in results["plain"]:
            assert torch.equal(results[key][name], results["plain"][name]), (key, name)
    # fp32 reference
    token_slots = _slots(lens, slots, rows).tolist()
    for name, in_dim, c, slices in MODULES:
        a, b = (t.float() for t in w[name])
        ref = outs[name].float().clone()
        for row, s in enumerate(token_slots):
            r = RANKS[s] if s >= 0 else 0
            if r == 0:
                continue
            xa = inputs[name][row].float() @ a[s, : c * r].T
            for k, (lo, hi) in enumerate(slices):
                ref[row, lo:hi] += SCALINGS[s] * (xa[k * r : (k + 1) * r] @ b[s, lo:hi, :r].T)
        delta, ref_delta = results["plain"][name].float() - outs[name].float(), ref - outs[name].float()
        assert (delta - ref_delta).norm() / ref_delta.norm() < 2e-2, name


@pytest.mark.parametrize("use_pdl", [False, True])
def test_graph_replay_matches_eager(use_pdl):
    bucket = 512
    gen = torch.Generator(device="cuda").manual_seed(7)
    w = _weights(gen)
    graph_runner = Runner(bucket, w, use_pdl)
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
            static_out[k][:live].copy_(outs[k])
        graph_runner.token_slots.copy_(_slots(lens, slots, bucket))
        graph.replay()
        eager = Runner(bucket, w, use_pdl)  # the same launches: grids depend on the rows only
        eager.token_slots.copy_(_slots(lens, slots, bucket))
        expected = {k: v.clone() for k, v in static_out.items()}
        for k in outs:
            expected[k][:live].copy_(outs[k])
        padded_in = {k: v.clone() for k, v in static_in.items()}
        eager.run(padded_in, expected)
        for k in static_out:
            assert torch.equal(static_out[k][:live], expected[k][:live]), (lens, k)
