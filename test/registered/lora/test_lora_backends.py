"""LoRA backends end to end (prepare_lora_batch + run_*) against `torch_native` (CPU, interpreter).

The batch mixes adapter A, the base model, adapter B and adapter A again, with different ranks.
Static (graph) infos are checked the way a graph uses them: the launch dimensions recorded at
"capture" (the Python ints of the info at that time) are restored before the kernels run, inputs
are padded to the captured size, and results must equal an eager run, also after a larger batch
left its segments in the static buffers.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from sglang.srt.lora.backend import get_backend_from_name
from sglang.srt.lora.backend.chunked_backend import MIN_CHUNK_SIZE, ChunkedSgmvLoRABackend, build_chunked_segments
from sglang.srt.lora.backend.torch_backend import TorchNativeLoRABackend
from sglang.srt.lora.backend.triton_backend import PREFILL_CUDA_GRAPH_LORA_SEGMENTS, TritonLoRABackend
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

HIDDEN, Q, KV, INTER, MAX_RANK = 32, 32, 16, 24, 16
MLPB = 4
# Slot 0: base (rank 0); slot 1: adapter A (rank 8); slot 2: adapter B (rank 16); slot 3: empty.
RANKS = [0, 8, 16, 0]
SCALINGS = [0.0, 2.0, 0.5, 0.0]
A_SLOT, BASE_SLOT, B_SLOT = 1, 0, 2


def make_batch(seq_lens: list[int], mode: ForwardMode = ForwardMode.EXTEND, pad_to: int = 0) -> ForwardBatch:
    """A ForwardBatch with only the fields LoRA backends read; `pad_to` pads the token rows."""
    bs = len(seq_lens)
    num_tokens = max(sum(seq_lens) if mode.is_extend() else bs, pad_to)
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    extend = mode.is_extend()
    return ForwardBatch(
        forward_mode=mode,
        batch_size=bs,
        input_ids=torch.zeros(num_tokens, dtype=torch.int64),
        positions=torch.zeros(num_tokens, dtype=torch.int64),
        out_cache_loc=torch.zeros(num_tokens, dtype=torch.int64),
        req_pool_indices=torch.arange(bs),
        seq_lens=lens,
        seq_lens_cpu=lens,
        extend_seq_lens=lens if extend else None,
        extend_prefix_lens=torch.zeros(bs, dtype=torch.int64) if extend else None,
        extend_start_loc=(torch.cumsum(lens, 0) - lens) if extend else None,
        extend_seq_lens_cpu=list(seq_lens) if extend else None,
        extend_prefix_lens_cpu=[0] * bs if extend else None,
        extend_num_tokens=sum(seq_lens) if extend else None,
    )


def make_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Pool-shaped weights; everything past an adapter's compact prefix is NaN (must never be read)."""
    gen = torch.Generator().manual_seed(seed)

    def pool(c: int, out_dim: int, in_dim: int):
        a = torch.randn(MLPB, c * MAX_RANK, in_dim, generator=gen) * 0.5
        b = torch.randn(MLPB, out_dim, MAX_RANK, generator=gen) * 0.5
        for slot, r in enumerate(RANKS):
            a[slot, c * r :] = float("nan")
            b[slot, :, r:] = float("nan")
        return a, b

    w = {}
    w["qkv_a"], w["qkv_b"] = pool(3, Q + 2 * KV, HIDDEN)
    w["gate_up_a"], w["gate_up_b"] = pool(2, 2 * INTER, HIDDEN)
    w["down_a"], w["down_b"] = pool(1, HIDDEN, INTER)
    return w


MAX_ROWS = 128
OUTPUT_OFFSET = torch.tensor([0, Q, Q + KV, Q + 2 * KV], dtype=torch.int32)


def run_layers(backend, x: torch.Tensor, w: dict[str, torch.Tensor], base_seed: int = 1) -> dict[str, torch.Tensor]:
    """The three calls a decoder layer makes, on fresh base outputs."""
    num_tokens = x.shape[0]

    def base(width: int, seed: int) -> torch.Tensor:
        # Row t gets the same values whatever the row count (padded replays compare row-wise).
        gen = torch.Generator().manual_seed(base_seed * 100 + seed)
        return torch.randn(MAX_ROWS, width, generator=gen)[:num_tokens].clone()

    qkv, gate_up, down, inter = base(Q + 2 * KV, 0), base(2 * INTER, 1), base(HIDDEN, 2), base(INTER, 3)
    return {
        "qkv": backend.run_qkv_lora(x, w["qkv_a"], w["qkv_b"], OUTPUT_OFFSET, max(Q, KV), qkv),
        "gate_up": backend.run_gate_up_lora(x, w["gate_up_a"], w["gate_up_b"], gate_up),
        "down": backend.run_lora_b_sgemm(backend.run_lora_a_sgemm(inter, w["down_a"]), w["down_b"], down),
    }


def reference(slots: list[int], seq_lens: list[int], x, w, mode=ForwardMode.EXTEND):
    ref = TorchNativeLoRABackend(MLPB, "cpu")
    ref.prepare_lora_batch(make_batch(seq_lens, mode), slots, RANKS, SCALINGS, use_cuda_graph=False)
    return run_layers(ref, x, w)


def assert_outputs_close(got, expected, rows: int | None = None):
    for name in expected:
        g = got[name] if rows is None else got[name][:rows]
        torch.testing.assert_close(g, expected[name][: g.shape[0]], rtol=1e-4, atol=1e-4, msg=name)


@contextlib.contextmanager
def frozen_launch_dims(backend, dims: tuple[int, int]):
    """Replay: the grid is the one recorded at capture, whatever the refresh set in Python."""
    info = backend.batch_info
    live = (info.bs, info.max_len)
    info.bs, info.max_len = dims
    try:
        yield
    finally:
        info.bs, info.max_len = live


MIXED_SLOTS = [A_SLOT, BASE_SLOT, B_SLOT, A_SLOT]
MIXED_LENS = [5, 3, 50, 9]  # 67 tokens: csgmv with max chunk 32 picks 32
BACKENDS = {
    "triton": lambda: TritonLoRABackend(MLPB, "cpu"),
    "csgmv": lambda: ChunkedSgmvLoRABackend(MLPB, "cpu"),
    "csgmv_chunk32": lambda: ChunkedSgmvLoRABackend(MLPB, "cpu", max_lora_chunk_size=32),
}


@pytest.mark.parametrize("name", list(BACKENDS))
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_eager_matches_torch_native(name, mode):
    w = make_weights()
    lens = MIXED_LENS if mode.is_extend() else [1] * 4
    x = torch.randn(sum(lens), HIDDEN, generator=torch.Generator().manual_seed(2))
    backend = BACKENDS[name]()
    backend.prepare_lora_batch(make_batch(lens, mode), MIXED_SLOTS, RANKS, SCALINGS, use_cuda_graph=False)
    got = run_layers(backend, x, w)
    expected = reference(MIXED_SLOTS, lens, x, w, mode)
    assert_outputs_close(got, expected)
    # The adapters did something and the base request did not.
    plain = run_layers(_all_base(), x, w)
    base_rows = slice(lens[0], lens[0] + lens[1])
    assert torch.equal(got["qkv"][base_rows], plain["qkv"][base_rows])
    assert not torch.allclose(got["qkv"][: lens[0]], plain["qkv"][: lens[0]])


def _all_base():
    b = TorchNativeLoRABackend(MLPB, "cpu")
    b.prepare_lora_batch(make_batch([1]), [BASE_SLOT], RANKS, SCALINGS, use_cuda_graph=False)
    return b


def test_csgmv_eager_all_base_launches_nothing():
    backend = ChunkedSgmvLoRABackend(MLPB, "cpu")
    backend.prepare_lora_batch(make_batch([4, 2]), [BASE_SLOT, 3], RANKS, SCALINGS, use_cuda_graph=False)
    assert backend.batch_info.bs == 0
    x = torch.randn(6, HIDDEN)
    w = make_weights()
    assert_outputs_close(run_layers(backend, x, w), reference([BASE_SLOT, 3], [4, 2], x, w))


# ---- static infos -----------------------------------------------------------------------------
def _padded(x: torch.Tensor, rows: int, seed: int = 9) -> torch.Tensor:
    pad = torch.randn(rows - x.shape[0], x.shape[1], generator=torch.Generator().manual_seed(seed))
    return torch.cat([x, pad])


def _prefill_capture(backend, bucket: int) -> tuple[int, int]:
    """What the prefill runner does before capture: an all-base batch of `bucket` tokens."""
    backend.prepare_lora_batch(
        make_batch([bucket]), [BASE_SLOT], [0] * MLPB, [0.0] * MLPB, use_cuda_graph=False, use_prefill_cuda_graph=True
    )
    info = backend.batch_info
    assert info is backend.prefill_cuda_graph_batch_info and info.use_cuda_graph
    return info.bs, info.max_len


# A large batch first (fills many segments), then smaller ones: stale tails must not re-apply.
PREFILL_SEQUENCE = [
    ([A_SLOT, B_SLOT, BASE_SLOT, B_SLOT, A_SLOT, A_SLOT, B_SLOT], [9, 17, 4, 6, 11, 2, 7]),
    (MIXED_SLOTS, [5, 3, 10, 4]),
    ([B_SLOT], [3]),
    ([BASE_SLOT, BASE_SLOT], [6, 1]),  # all-base batch after adapter batches
]


@pytest.mark.parametrize("name", ["triton", "csgmv"])
def test_prefill_static_info_matches_eager(name):
    bucket = 64
    w = make_weights(3)
    backend = BACKENDS[name]()
    backend.init_prefill_cuda_graph_batch_info(max_num_tokens=bucket)
    assert backend.prefill_cuda_graph_max_tokens == bucket
    dims = _prefill_capture(backend, bucket)
    for step, (slots, lens) in enumerate(PREFILL_SEQUENCE):
        live_tokens = sum(lens)
        x = torch.randn(live_tokens, HIDDEN, generator=torch.Generator().manual_seed(step))
        backend.prepare_lora_batch(
            make_batch(lens), slots, RANKS, SCALINGS, use_cuda_graph=False, use_prefill_cuda_graph=True
        )
        assert backend.batch_info is backend.prefill_cuda_graph_batch_info
        expected = reference(slots, lens, x, w)
        # Eager consumption of the in-place info is valid too.
        assert_outputs_close(run_layers(backend, x, w), expected)
        with frozen_launch_dims(backend, dims):
            replayed = run_layers(backend, _padded(x, bucket), w)
        assert_outputs_close(replayed, expected, rows=live_tokens)
        # Padded rows are outside every segment: the base outputs there are untouched.
        untouched = run_layers(_all_base(), _padded(x, bucket), w)
        for key in replayed:
            assert torch.equal(replayed[key][live_tokens:], untouched[key][live_tokens:]), key


@pytest.mark.parametrize("name", ["triton", "csgmv"])
def test_decode_static_info_matches_eager(name):
    max_bs = 8
    w = make_weights(4)
    backend = BACKENDS[name]()
    backend.init_cuda_graph_batch_info(max_bs, 1)
    assert backend.max_bs_in_cuda_graph == max_bs
    # Capture at the largest bucket with an all-base batch.
    backend.prepare_lora_batch(
        make_batch([1] * max_bs, ForwardMode.DECODE), [BASE_SLOT] * max_bs, [0] * MLPB, [0.0] * MLPB, use_cuda_graph=True
    )
    dims = (backend.batch_info.bs, backend.batch_info.max_len)
    for slots in ([A_SLOT, B_SLOT, A_SLOT, BASE_SLOT, B_SLOT, B_SLOT, A_SLOT, A_SLOT], [B_SLOT, BASE_SLOT, A_SLOT], [BASE_SLOT]):
        bs = len(slots)
        x = torch.randn(bs, HIDDEN, generator=torch.Generator().manual_seed(bs))
        backend.prepare_lora_batch(make_batch([1] * bs, ForwardMode.DECODE), slots, RANKS, SCALINGS, use_cuda_graph=True)
        assert backend.batch_info is backend.cuda_graph_batch_info
        expected = reference(slots, [1] * bs, x, w, ForwardMode.DECODE)
        assert_outputs_close(run_layers(backend, x, w), expected)
        with frozen_launch_dims(backend, dims):
            replayed = run_layers(backend, _padded(x, max_bs), w)
        # Padded decode rows may run with stale slot ids (their outputs are discarded).
        assert_outputs_close(replayed, expected, rows=bs)


def test_csgmv_static_tail_is_neutralised():
    backend = ChunkedSgmvLoRABackend(MLPB, "cpu")
    backend.init_prefill_cuda_graph_batch_info(max_num_tokens=64)
    info = backend.prefill_cuda_graph_batch_info
    assert info.bs == max(-(-64 // MIN_CHUNK_SIZE) + MLPB, 16) and info.max_len == MIN_CHUNK_SIZE
    assert backend.prefill_cuda_graph_max_bs == 64
    slots, lens = PREFILL_SEQUENCE[0]
    backend.prepare_lora_batch(make_batch(lens), slots, RANKS, SCALINGS, False, True)
    big = info.num_segments
    backend.prepare_lora_batch(make_batch([3]), [B_SLOT], RANKS, SCALINGS, False, True)
    assert info.num_segments == 1 < big
    assert info.bs == 16  # the grid's segment axis follows the rows of the batch (3), at least 16
    indptr = info.seg_indptr.tolist()
    assert indptr[:2] == [0, 3] and set(indptr[2:]) == {3}
    assert all(RANKS[s] == 0 for s in info.weight_indices.tolist()[1:])


def test_triton_prefill_static_layout_and_cap():
    backend = TritonLoRABackend(MLPB, "cpu")
    backend.init_prefill_cuda_graph_batch_info(max_num_tokens=128)
    info = backend.prefill_cuda_graph_batch_info
    n = PREFILL_CUDA_GRAPH_LORA_SEGMENTS
    assert (info.bs, info.seg_lens.numel(), info.seg_indptr.numel(), info.weight_indices.numel()) == (n, n, n + 1, n)
    assert info.lora_ranks.numel() == MLPB and info.use_cuda_graph
    assert backend.prefill_cuda_graph_max_bs == n and backend.prefill_cuda_graph_max_tokens == 128
    backend.prepare_lora_batch(make_batch([3, 2], pad_to=16), [A_SLOT, B_SLOT], RANKS, SCALINGS, False, True)
    assert info.bs == n and info.num_segments == 2 and info.max_len == 16  # max_len = padded rows
    assert info.seg_lens.tolist() == [3, 2] + [0] * (n - 2)
    assert info.seg_indptr.tolist() == [0, 3] + [5] * (n - 1)
    with pytest.raises(AssertionError):
        backend.prepare_lora_batch(make_batch([1] * (n + 1)), [A_SLOT] * (n + 1), RANKS, SCALINGS, False, True)


# ---- host-side pieces -------------------------------------------------------------------------
def test_chunk_size_rule():
    assert ChunkedSgmvLoRABackend(MLPB, "cpu", 16).chunk_size(4096) == 16
    b = ChunkedSgmvLoRABackend(MLPB, "cpu", 128)
    assert [b.chunk_size(n) for n in (1, 63, 64, 255, 256, 10_000)] == [16, 16, 32, 32, 128, 128]
    assert ChunkedSgmvLoRABackend(MLPB, "cpu", 64).chunk_size(10_000) == 64


def test_build_chunked_segments_sorts_stably_and_skips_base():
    segs = build_chunked_segments([A_SLOT, BASE_SLOT, B_SLOT, A_SLOT], [3, 2, 20, 2], RANKS, chunk=16)
    perm = segs.permutation.tolist()
    assert sorted(perm) == list(range(27))
    # A's tokens (rows 0-2, 25-26) in order, then B's (5-24), then base rows (3-4) uncovered.
    assert perm == [0, 1, 2, 25, 26] + list(range(5, 25)) + [3, 4]
    assert segs.seg_indptr == [0, 5, 21, 25] and segs.weight_indices == [A_SLOT, B_SLOT, B_SLOT]


def test_registry_and_capabilities():
    assert get_backend_from_name("triton") is TritonLoRABackend
    assert get_backend_from_name("csgmv") is ChunkedSgmvLoRABackend
    assert get_backend_from_name("torch_native") is TorchNativeLoRABackend
    assert TritonLoRABackend.supports_prefill_cuda_graph and ChunkedSgmvLoRABackend.supports_prefill_cuda_graph
    assert not TorchNativeLoRABackend.supports_prefill_cuda_graph
    with pytest.raises(ValueError, match="csgmv, torch_native, triton"):
        get_backend_from_name("punica")
    native = TorchNativeLoRABackend(MLPB, "cpu")
    with pytest.raises(ValueError):
        native.prepare_lora_batch(make_batch([2]), [A_SLOT], RANKS, SCALINGS, False, True)
    with pytest.raises(NotImplementedError):
        native.init_prefill_cuda_graph_batch_info(64)


def test_csgmv_eager_chunking_follows_the_token_count():
    backend = ChunkedSgmvLoRABackend(MLPB, "cpu", max_lora_chunk_size=32)
    backend.prepare_lora_batch(make_batch(MIXED_LENS), MIXED_SLOTS, RANKS, SCALINGS, use_cuda_graph=False)
    info = backend.batch_info
    assert info.max_len == 32
    # A: 5 + 9 = 14 tokens -> 1 chunk; B: 50 tokens -> 2 chunks; base: none.
    assert info.weight_indices.tolist() == [A_SLOT, B_SLOT, B_SLOT]
    assert info.seg_indptr.tolist() == [0, 14, 46, 64]
    assert info.bs == info.num_segments == 3
