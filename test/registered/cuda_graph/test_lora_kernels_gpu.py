"""LoRA backends on the GPU: bf16 parity at Qwen3-4B shapes, and real CUDA-graph capture/replay.

Both token-major backends, with their modules folded into the base GEMM (W_aug) and unfolded
(triton: token-major shrink/expand; csgmv: chunked SGMV). The graph tests do what the prefill and
decode graph runners do: capture every module call of a layer once with an all-base batch of the
bucket's rows, then, for a sequence of live batches (up to 40 adapter requests, then an all-base
one), refresh the static metadata in place, copy inputs into the static buffers and replay. The
replay must equal, bit for bit, an eager run of the same padded rows (the same launches and GEMM
shapes), and the eager run of the live rows within bf16 rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.lora.backend.chunked_backend import ChunkedSgmvLoRABackend
from sglang.srt.lora.backend.torch_backend import TorchNativeLoRABackend
from sglang.srt.lora.backend.token_backend import TokenLoRABackend
from sglang.srt.lora.fold import fold_weight
from sglang.srt.lora.utils import LoRAModuleSpec, LoRAModuleWeights
from sglang.srt.configs.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.configs.forward_path import ForwardPath

pytestmark = pytest.mark.gpu

# Qwen3-4B
HIDDEN, Q, KV, INTER = 2560, 4096, 1024, 9728
NUM_SLOTS = 4
DEV = "cuda"
DTYPE = torch.bfloat16
MODULES = {"qkv_proj": (HIDDEN, (Q, KV, KV)), "o_proj": (Q, (HIDDEN,)), "gate_up_proj": (HIDDEN, (INTER, INTER)),
           "down_proj": (INTER, (HIDDEN,))}
INPUT_OF = {"qkv_proj": "x", "gate_up_proj": "x", "o_proj": "attn", "down_proj": "act"}
SLOTS_RANKS = {16: [0, 16, 8, 16], 64: [0, 64, 32, 64]}
SCALINGS = [0.0, 2.0, 0.5, 1.0]


def make_batch(seq_lens: list[int], mode: ForwardMode = ForwardMode.EXTEND, pad_to: int = 0) -> ForwardBatch:
    bs = len(seq_lens)
    extend = mode.is_extend()
    num_tokens = max(sum(seq_lens) if extend else bs, pad_to)
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    lens_dev = lens.to(DEV)
    return ForwardBatch(
        forward_mode=mode,
        batch_size=bs,
        input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=DEV),
        positions=torch.zeros(num_tokens, dtype=torch.int64, device=DEV),
        out_cache_loc=torch.zeros(num_tokens, dtype=torch.int64, device=DEV),
        req_pool_indices=torch.arange(bs, device=DEV),
        seq_lens=lens_dev,
        seq_lens_cpu=lens,
        extend_seq_lens=lens_dev if extend else None,
        extend_start_loc=(torch.cumsum(lens_dev, 0) - lens_dev) if extend else None,
        extend_seq_lens_cpu=list(seq_lens) if extend else None,
        extend_num_tokens=sum(seq_lens) if extend else None,
    )


class _Linear(nn.Module):
    def __init__(self, weight, bias=None):
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class Layer:
    """One decoder layer's four modules with pool-shaped adapters (zero past each prefix, as the
    pool keeps them), laid out plain or folded, registered with a backend."""

    def __init__(self, backend, max_rank: int, ranks: list[int], fold: bool, seed: int = 0):
        gen = torch.Generator(device=DEV).manual_seed(seed)
        dtype = DTYPE
        self.backend, self.modules = backend, {}
        for name, (in_dim, slices) in MODULES.items():
            c, out = len(slices), sum(slices)
            w = (torch.randn(out, in_dim, generator=gen, device=DEV) / in_dim**0.5).to(dtype)
            a = torch.randn(NUM_SLOTS, c * max_rank, in_dim, generator=gen, device=DEV) / in_dim**0.5
            b = torch.randn(NUM_SLOTS, out, max_rank, generator=gen, device=DEV) / max_rank**0.5
            for slot, r in enumerate(ranks):
                a[slot, c * r :] = 0
                b[slot, :, r:] = 0
            a, b = a.to(dtype), b.to(dtype)
            spec = LoRAModuleSpec(name, in_dim, slices, max_rank)
            if fold:
                w_aug, sliced = fold_weight(w, slices, NUM_SLOTS, max_rank)
                for slot in range(NUM_SLOTS):
                    sliced[slot].copy_(b[slot])
                spec = LoRAModuleSpec(name, in_dim, slices, max_rank, w_aug.shape[1] - in_dim)
                weights, base = LoRAModuleWeights(spec, a, sliced, None, w_aug), _Linear(w_aug[:, :in_dim])
            else:
                weights, base = LoRAModuleWeights(spec, a, b, None), _Linear(w)
            self.modules[name] = (weights, base)
        backend.init_modules({n: m[0].spec for n, m in self.modules.items()},
                             torch.tensor(ranks, dtype=torch.int32, device=DEV),
                             torch.tensor(SCALINGS, dtype=torch.float32, device=DEV), dtype)

    def reference(self, lens, slots, ranks, mode) -> "Layer":
        """A torch_native layer over fp32 copies of these weights, prepared for the batch."""
        ref = Layer.__new__(Layer)
        ref.backend, ref.modules = TorchNativeLoRABackend(NUM_SLOTS, DEV), {}
        for name, (w, base) in self.modules.items():
            spec = LoRAModuleSpec(name, w.spec.in_dim, w.spec.slice_sizes, w.spec.max_rank)
            b = w.B.dense() if w.folded is not None else w.B
            ref.modules[name] = (LoRAModuleWeights(spec, w.A.float(), b.float(), None), _Linear(base.weight.float()))
        ref.backend.fill_batch_info(make_batch(lens, mode), slots, ranks, SCALINGS, ForwardPath.EAGER)
        return ref

    def run(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: self.backend.run_module(w, base, inputs[INPUT_OF[n]]) for n, (w, base) in self.modules.items()}


def make_inputs(rows: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return {k: torch.randn(rows, d, generator=gen, device=DEV).to(DTYPE) for k, d in (("x", HIDDEN), ("attn", Q), ("act", INTER))}


def assert_close_rel(got, expected, rows: int, rel: float = 2e-2):
    for key in expected:
        g, e = got[key][:rows].float(), expected[key][:rows].float()
        assert torch.isfinite(g).all(), key
        err = (g - e).norm().item() / max(e.norm().item(), 1e-30)
        assert err < rel, f"{key}: relative error {err:.3e}"


CONFIGS = [(cls, fold) for cls in (TokenLoRABackend, ChunkedSgmvLoRABackend) for fold in (True, False)]


def _reference(layer: Layer, lens, slots, ranks, mode, inputs):
    return layer.reference(lens, slots, ranks, mode).run({k: v.float() for k, v in inputs.items()})


# Each backend and layout once at rank 16 and once at 64 between them (compiles cost GPU time).
PARITY = [(TokenLoRABackend, True, 16), (ChunkedSgmvLoRABackend, True, 64), (TokenLoRABackend, False, 64),
          (ChunkedSgmvLoRABackend, False, 16)]


@pytest.mark.parametrize("backend_cls,fold,max_rank", PARITY)
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_bf16_parity_real_shapes(max_rank, backend_cls, fold, mode):
    ranks = SLOTS_RANKS[max_rank]
    if mode.is_extend():
        lens, slots = [1, 37, 300, 5, 1024, 64], [1, 0, 2, 3, 1, 2]
    else:
        lens, slots = [1] * 24, [i % NUM_SLOTS for i in range(24)]
    rows = sum(lens) if mode.is_extend() else len(lens)
    inputs = make_inputs(rows, seed=1)
    layer = Layer(backend_cls(NUM_SLOTS, DEV), max_rank, ranks, fold)
    layer.backend.fill_batch_info(make_batch(lens, mode), slots, ranks, SCALINGS, ForwardPath.EAGER)
    got = layer.run(inputs)
    ref = _reference(layer, lens, slots, ranks, mode, inputs)
    base = {n: F.linear(inputs[INPUT_OF[n]].float(), l[1].weight.float()) for n, l in layer.modules.items()}
    # The LoRA deltas (output - base), relative Frobenius error: bf16 rounding gives ~3e-3.
    assert_close_rel({k: got[k].float() - base[k] for k in got}, {k: ref[k] - base[k] for k in ref}, rows)


def _capture(layer: Layer, static_inputs) -> tuple[torch.cuda.CUDAGraph, dict]:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (Triton compilation) on the capture stream
        layer.run(static_inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer.run(static_inputs)
    return graph, static_out


def _load_static(static: dict, live: dict, rows: int):
    for key, tensor in live.items():
        static[key][:rows].copy_(tensor)
        static[key][rows:].normal_()  # padding rows hold garbage, as in a padded bucket


def _live_batches(max_requests: int, bucket: int, seed: int = 0):
    """1..max_requests requests of mixed slots within the bucket, then an all-base batch."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for n in sorted({1, 2, 7, 16, max_requests}):
        lens = (torch.randint(1, max(2, bucket // n), (n,), generator=gen)).tolist()
        slots = torch.randint(0, NUM_SLOTS, (n,), generator=gen).tolist()
        batches.append((lens, slots))
    batches.sort(key=lambda b: -len(b[0]))  # larger batches first: stale tails must not re-apply
    batches.append(([50, 3, 200], [0, 0, 0]))
    return batches


@pytest.mark.parametrize("backend_cls,fold", CONFIGS)
def test_prefill_graph_replay_matches_eager(backend_cls, fold):
    bucket, max_rank = 1024, 16
    ranks = SLOTS_RANKS[max_rank]
    layer = Layer(backend_cls(NUM_SLOTS, DEV), max_rank, ranks, fold)
    layer.backend.init_prefill_cuda_graph_batch_info(max_num_tokens=bucket)
    # Capture with an all-base batch that fills the bucket (what the runner does).
    zeros = [0] * NUM_SLOTS
    layer.backend.fill_batch_info(make_batch([bucket]), [0], zeros, [0.0] * NUM_SLOTS, ForwardPath.PREFILL_GRAPH)
    static_inputs = make_inputs(bucket, seed=5)
    graph, static_out = _capture(layer, static_inputs)
    padded = Layer(backend_cls(NUM_SLOTS, DEV), max_rank, ranks, fold)  # same seed: same weights
    live_eager = Layer(backend_cls(NUM_SLOTS, DEV), max_rank, ranks, fold)
    for lens, slots in _live_batches(40, bucket):
        rows = sum(lens)
        inputs = make_inputs(rows, seed=rows)
        layer.backend.fill_batch_info(make_batch(lens), slots, ranks, SCALINGS, ForwardPath.PREFILL_GRAPH)
        _load_static(static_inputs, inputs, rows)
        graph.replay()
        # Eager on the same padded rows: the same launches and GEMM shapes, hence the same bits.
        padded.backend.fill_batch_info(make_batch(lens, pad_to=bucket), slots, ranks, SCALINGS, ForwardPath.EAGER)
        same_rows = padded.run(static_inputs)
        for key in static_out:
            assert torch.equal(static_out[key][:rows], same_rows[key][:rows]), (len(lens), key)
        live_eager.backend.fill_batch_info(make_batch(lens), slots, ranks, SCALINGS, ForwardPath.EAGER)
        assert_close_rel(static_out, live_eager.run(inputs), rows, rel=1e-2)
        if all(ranks[s] == 0 for s in slots):  # all base: exactly the base layers' outputs
            for name, (w, base) in layer.modules.items():
                torch.testing.assert_close(static_out[name][:rows], base(inputs[INPUT_OF[name]]), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("backend_cls,fold", CONFIGS)
def test_decode_graph_replay_matches_eager(backend_cls, fold):
    max_bs, max_rank = 32, 64
    ranks = SLOTS_RANKS[max_rank]
    decode = ForwardMode.DECODE
    layer = Layer(backend_cls(NUM_SLOTS, DEV), max_rank, ranks, fold)
    layer.backend.init_cuda_graph_batch_info(max_bs, 1)
    layer.backend.fill_batch_info(make_batch([1] * max_bs, decode), [0] * max_bs, [0] * NUM_SLOTS,
                                     [0.0] * NUM_SLOTS, ForwardPath.DECODE_GRAPH)
    static_inputs = make_inputs(max_bs, seed=6)
    graph, static_out = _capture(layer, static_inputs)
    padded = Layer(backend_cls(NUM_SLOTS, DEV), max_rank, ranks, fold)
    for step, bs in enumerate([32, 7, 1, 19]):
        slots = [(i * 7 + step) % NUM_SLOTS for i in range(bs)]
        inputs = make_inputs(bs, seed=20 + step)
        layer.backend.fill_batch_info(make_batch([1] * bs, decode), slots, ranks, SCALINGS, ForwardPath.DECODE_GRAPH)
        _load_static(static_inputs, inputs, bs)
        graph.replay()
        # Eager on the bucket's rows (padding rows as base requests, rank 0 like the graph's -1).
        padded.backend.fill_batch_info(make_batch([1] * bs + [1] * (max_bs - bs), decode),
                                          slots + [0] * (max_bs - bs), ranks, SCALINGS, ForwardPath.EAGER)
        same_rows = padded.run(static_inputs)
        for key in static_out:
            assert torch.equal(static_out[key][:bs], same_rows[key][:bs]), (bs, key)
        assert_close_rel(static_out, _reference(layer, [1] * bs, slots, ranks, decode, inputs), bs)


def test_csgmv_expand_as_a_dependent_replays_like_eager(monkeypatch):
    """sgemm_lora_b.PDL_MAX_ROWS past every batch: csgmv's unfolded expand launched as a programmatic
    dependent of the GEMM before it. Graph replays still equal eager on the same rows bit for bit and
    the reference within bf16 rounding (decode and prefill)."""
    from sglang.srt.lora.triton_ops import sgemm_lora_b

    if not ChunkedSgmvLoRABackend(NUM_SLOTS, DEV).use_pdl:
        pytest.skip("no programmatic dependent launch on this GPU")
    monkeypatch.setattr(sgemm_lora_b, "PDL_MAX_ROWS", 1 << 20)
    test_decode_graph_replay_matches_eager(ChunkedSgmvLoRABackend, False)
    test_prefill_graph_replay_matches_eager(ChunkedSgmvLoRABackend, False)
