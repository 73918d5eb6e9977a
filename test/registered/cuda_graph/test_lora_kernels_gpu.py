"""LoRA kernels on the GPU: bf16 parity at Qwen3-4B shapes, and real CUDA-graph capture/replay.

The graph tests do what the prefill and decode graph runners do: capture every LoRA call of a
layer once with the static info holding rank 0 everywhere, then, for a sequence of live batches,
refresh the static info in place, copy inputs into the static buffers, replay, and compare with an
eager run on a separate backend instance.
"""

from __future__ import annotations

import pytest
import torch

from sglang.srt.lora.backend.chunked_backend import ChunkedSgmvLoRABackend
from sglang.srt.lora.backend.torch_backend import TorchNativeLoRABackend
from sglang.srt.lora.backend.triton_backend import PREFILL_CUDA_GRAPH_LORA_SEGMENTS, TritonLoRABackend
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

pytestmark = pytest.mark.gpu

# Qwen3-4B
HIDDEN, Q, KV, INTER = 2560, 4096, 1024, 9728
MLPB = 4
DEV = "cuda"


def make_batch(seq_lens: list[int], mode: ForwardMode = ForwardMode.EXTEND) -> ForwardBatch:
    bs = len(seq_lens)
    extend = mode.is_extend()
    num_tokens = sum(seq_lens) if extend else bs
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
        extend_num_tokens=num_tokens if extend else None,
    )


def make_pool(max_rank: int, ranks: list[int], dtype=torch.bfloat16, seed: int = 0) -> dict[str, torch.Tensor]:
    """Pool-shaped weights (slots x stacked rank x in). Past each slot's prefix: large garbage."""
    gen = torch.Generator(device=DEV).manual_seed(seed)

    def pool(c: int, out_dim: int, in_dim: int):
        a = torch.randn(MLPB, c * max_rank, in_dim, generator=gen, device=DEV) / in_dim**0.5
        b = torch.randn(MLPB, out_dim, max_rank, generator=gen, device=DEV) / max_rank**0.5
        for slot, r in enumerate(ranks):
            a[slot, c * r :] = 1e4
            b[slot, :, r:] = 1e4
        return a.to(dtype), b.to(dtype)

    w = {}
    w["qkv_a"], w["qkv_b"] = pool(3, Q + 2 * KV, HIDDEN)
    w["gate_up_a"], w["gate_up_b"] = pool(2, 2 * INTER, HIDDEN)
    w["o_a"], w["o_b"] = pool(1, HIDDEN, Q)
    w["down_a"], w["down_b"] = pool(1, HIDDEN, INTER)
    return w


OFFSETS = [0, Q, Q + KV, Q + 2 * KV]


def run_layer(backend, inputs: dict[str, torch.Tensor], bases: dict[str, torch.Tensor], w) -> dict[str, torch.Tensor]:
    """Every LoRA call of one decoder layer, each on a copy of its base output."""
    offsets = inputs["offsets"]
    out = {k: v.clone() for k, v in bases.items()}
    backend.run_qkv_lora(inputs["x"], w["qkv_a"], w["qkv_b"], offsets, max(Q, KV), out["qkv"])
    backend.run_gate_up_lora(inputs["x"], w["gate_up_a"], w["gate_up_b"], out["gate_up"])
    backend.run_lora_b_sgemm(backend.run_lora_a_sgemm(inputs["attn"], w["o_a"]), w["o_b"], out["o"])
    backend.run_lora_b_sgemm(backend.run_lora_a_sgemm(inputs["act"], w["down_a"]), w["down_b"], out["down"])
    return out


def make_io(num_tokens: int, dtype=torch.bfloat16, seed: int = 1):
    gen = torch.Generator(device=DEV).manual_seed(seed)

    def rnd(width):
        return torch.randn(num_tokens, width, generator=gen, device=DEV).to(dtype)

    inputs = {
        "x": rnd(HIDDEN),
        "attn": rnd(Q),
        "act": rnd(INTER),
        "offsets": torch.tensor(OFFSETS, dtype=torch.int32, device=DEV),
    }
    bases = {"qkv": rnd(Q + 2 * KV), "gate_up": rnd(2 * INTER), "o": rnd(HIDDEN), "down": rnd(HIDDEN)}
    return inputs, bases


def assert_delta_close(got, expected, bases, rows: int, rel: float = 2e-2):
    """Compare the LoRA deltas (output - base) by relative Frobenius error, per module."""
    for key in expected:
        d_got = got[key][:rows].float() - bases[key][:rows].float()
        d_ref = expected[key][:rows].float() - bases[key][:rows].float()
        assert torch.isfinite(d_got).all(), key
        denom = d_ref.norm().item()
        if denom == 0:
            assert d_got.abs().max().item() == 0, key
        else:
            err = (d_got - d_ref).norm().item() / denom
            assert err < rel, f"{key}: relative error {err:.3e}"


SLOTS_RANKS = {16: [0, 16, 8, 16], 64: [0, 64, 32, 64]}
SCALINGS = [0.0, 2.0, 0.5, 1.0]


@pytest.mark.parametrize("max_rank", [16, 64])
@pytest.mark.parametrize("backend_cls", [TritonLoRABackend, ChunkedSgmvLoRABackend])
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_bf16_parity_real_shapes(max_rank, backend_cls, mode):
    ranks = SLOTS_RANKS[max_rank]
    w = make_pool(max_rank, ranks)
    w32 = {k: v.float() for k, v in w.items()}
    if mode.is_extend():
        lens = [1, 37, 300, 5, 1024, 64]
        slots = [1, 0, 2, 3, 1, 2]
    else:
        lens = [1] * 24
        slots = [i % MLPB for i in range(24)]
    num_tokens = sum(lens) if mode.is_extend() else len(lens)
    inputs, bases = make_io(num_tokens)
    backend = backend_cls(MLPB, DEV, max_lora_chunk_size=128)
    backend.prepare_lora_batch(make_batch(lens, mode), slots, ranks, SCALINGS, use_cuda_graph=False)
    got = run_layer(backend, inputs, bases, w)

    ref_backend = TorchNativeLoRABackend(MLPB, DEV)
    ref_backend.prepare_lora_batch(make_batch(lens, mode), slots, ranks, SCALINGS, use_cuda_graph=False)
    ref = run_layer(
        ref_backend,
        {k: (v.float() if v.is_floating_point() else v) for k, v in inputs.items()},
        {k: v.float() for k, v in bases.items()},
        w32,
    )
    assert_delta_close(got, ref, bases, num_tokens)


# ---- CUDA graphs --------------------------------------------------------------------------------
def _capture(backend, static_inputs, static_bases, w) -> tuple[torch.cuda.CUDAGraph, dict]:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (Triton compilation) on the capture stream
        run_layer(backend, static_inputs, static_bases, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = run_layer(backend, static_inputs, static_bases, w)
    return graph, static_out


def _load_static(static: dict, live: dict, rows: int):
    for key, tensor in live.items():
        if key == "offsets":
            continue
        static[key][:rows].copy_(tensor)
        static[key][rows:].normal_()  # padding rows hold garbage, as in a padded bucket


def _live_batches(max_requests: int, bucket: int, seed: int = 0):
    """1..max_requests segments of mixed slots within the bucket, then an all-base batch."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for n in sorted({1, 2, 7, 16, max_requests}):
        lens = (torch.randint(1, max(2, bucket // n), (n,), generator=gen)).tolist()
        slots = torch.randint(0, MLPB, (n,), generator=gen).tolist()
        batches.append((lens, slots))
    batches.sort(key=lambda b: -len(b[0]))  # larger batches first: stale tails must not re-apply
    batches.append(([50, 3, 200], [0, 0, 0]))
    return batches


@pytest.mark.parametrize("backend_cls", [TritonLoRABackend, ChunkedSgmvLoRABackend])
def test_prefill_graph_replay_matches_eager(backend_cls):
    bucket, max_rank = 1024, 16
    ranks = SLOTS_RANKS[max_rank]
    w = make_pool(max_rank, ranks)
    backend = backend_cls(MLPB, DEV)
    backend.init_prefill_cuda_graph_batch_info(max_num_tokens=bucket)
    # Capture with an all-base batch that fills the bucket (what the runner does).
    backend.prepare_lora_batch(make_batch([bucket]), [0], [0] * MLPB, [0.0] * MLPB, False, use_prefill_cuda_graph=True)
    static_inputs, static_bases = make_io(bucket, seed=5)
    graph, static_out = _capture(backend, static_inputs, static_bases, w)

    max_requests = PREFILL_CUDA_GRAPH_LORA_SEGMENTS - 1 if backend_cls is TritonLoRABackend else 40
    for step, (lens, slots) in enumerate(_live_batches(max_requests, bucket)):
        rows = sum(lens)
        inputs, bases = make_io(rows, seed=10 + step)
        backend.prepare_lora_batch(make_batch(lens), slots, ranks, SCALINGS, False, use_prefill_cuda_graph=True)
        _load_static(static_inputs, inputs, rows)
        _load_static(static_bases, bases, rows)
        graph.replay()

        eager = backend_cls(MLPB, DEV)
        eager.prepare_lora_batch(make_batch(lens), slots, ranks, SCALINGS, use_cuda_graph=False)
        expected = run_layer(eager, inputs, bases, w)
        assert_delta_close(static_out, expected, bases, rows, rel=1e-2)
        for key in static_out:  # padded rows are outside every segment
            assert torch.equal(static_out[key][rows:], static_bases[key][rows:]), key
        if all(ranks[s] == 0 for s in slots):
            for key in static_out:
                assert torch.equal(static_out[key][:rows], bases[key]), key


@pytest.mark.parametrize("backend_cls", [TritonLoRABackend, ChunkedSgmvLoRABackend])
def test_decode_graph_replay_matches_eager(backend_cls):
    max_bs, max_rank = 32, 64
    ranks = SLOTS_RANKS[max_rank]
    w = make_pool(max_rank, ranks)
    backend = backend_cls(MLPB, DEV)
    backend.init_cuda_graph_batch_info(max_bs, 1)
    decode = ForwardMode.DECODE
    backend.prepare_lora_batch(make_batch([1] * max_bs, decode), [0] * max_bs, [0] * MLPB, [0.0] * MLPB, True)
    static_inputs, static_bases = make_io(max_bs, seed=6)
    graph, static_out = _capture(backend, static_inputs, static_bases, w)

    for step, bs in enumerate([32, 7, 1, 19]):
        slots = [(i * 7 + step) % MLPB for i in range(bs)]
        inputs, bases = make_io(bs, seed=20 + step)
        backend.prepare_lora_batch(make_batch([1] * bs, decode), slots, ranks, SCALINGS, True)
        _load_static(static_inputs, inputs, bs)
        _load_static(static_bases, bases, bs)
        graph.replay()
        eager = backend_cls(MLPB, DEV)
        eager.prepare_lora_batch(make_batch([1] * bs, decode), slots, ranks, SCALINGS, False)
        assert_delta_close(static_out, run_layer(eager, inputs, bases, w), bases, bs, rel=1e-2)
