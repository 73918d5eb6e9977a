"""LoRA backends end to end (fill_batch_info + run_module) against `torch_native` (CPU, interpreter).

Every token-major backend runs both module layouts: folded (W_aug, one GEMM over [x | shrink]) and
unfolded (base GEMM + shrink + expand; csgmv's chunked kernels). The batch mixes adapter A, the
base model, adapter B and adapter A again, with different ranks. Static (graph) infos are checked
the way a graph uses them: the launches recorded at "capture" (an all-base batch of the bucket's
rows) run on inputs padded to the bucket after each in-place refresh, and must give what an eager
run gives, also after a larger batch left its metadata in the static buffers.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.lora.backend import get_backend_from_name
from sglang.srt.lora.backend.chunked_backend import ChunkedSgmvLoRABackend
from sglang.srt.lora.backend.torch_backend import TorchNativeLoRABackend
from sglang.srt.lora.backend.token_backend import TokenLoRABackend
from sglang.srt.lora.fold import fold_weight
from sglang.srt.lora.segments import build_segments, segment_capacity
from sglang.srt.lora.utils import LoRAModuleSpec, LoRAModuleWeights
from sglang.srt.configs.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.configs.forward_path import ForwardPath

HIDDEN, Q, KV, INTER, MAX_RANK = 32, 32, 16, 24, 16
NUM_SLOTS = 4
# Slot 0: base (rank 0); slot 1: adapter A (rank 8); slot 2: adapter B (rank 16); slot 3: empty.
RANKS = [0, 8, 16, 0]
SCALINGS = [0.0, 2.0, 0.5, 0.0]
A_SLOT, BASE_SLOT, B_SLOT = 1, 0, 2
MODULES = {"qkv_proj": (HIDDEN, (Q, KV, KV)), "gate_up_proj": (HIDDEN, (INTER, INTER)), "down_proj": (INTER, (HIDDEN,))}
MAX_ROWS = 128


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


class _Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Module:
    """One module's base weights and pool-shaped adapters, laid out for a backend as the pool
    would: plain buffers (NaN past each adapter's prefix: never read) or folded into W_aug (zero
    there, the pool's invariant), with A's NaN poison either way."""

    def __init__(self, name: str, gen: torch.Generator) -> None:
        in_dim, slices = MODULES[name]
        c, out = len(slices), sum(slices)
        self.spec = LoRAModuleSpec(name, in_dim, slices, MAX_RANK)
        self.weight = torch.randn(out, in_dim, generator=gen) * 0.3
        self.bias = torch.randn(out, generator=gen) * 0.1
        self.a = torch.randn(NUM_SLOTS, c * MAX_RANK, in_dim, generator=gen) * 0.5
        self.b = torch.randn(NUM_SLOTS, out, MAX_RANK, generator=gen) * 0.5
        for slot, r in enumerate(RANKS):
            self.a[slot, c * r :] = float("nan")
            self.b[slot, :, r:] = float("nan")

    def plain(self) -> tuple[LoRAModuleWeights, nn.Module]:
        return LoRAModuleWeights(self.spec, self.a, self.b, self.bias), _Linear(self.weight, self.bias)

    def folded(self) -> tuple[LoRAModuleWeights, nn.Module]:
        w_aug, sliced = fold_weight(self.weight, self.spec.slice_sizes, NUM_SLOTS, MAX_RANK)
        for slot, r in enumerate(RANKS):
            sliced[slot][:, :r].copy_(self.b[slot, :, :r])
        spec = LoRAModuleSpec(self.spec.name, self.spec.in_dim, self.spec.slice_sizes, MAX_RANK,
                              w_aug.shape[1] - self.spec.in_dim)
        base = _Linear(w_aug[:, : self.spec.in_dim], self.bias)
        return LoRAModuleWeights(spec, self.a, sliced, self.bias, w_aug), base


@pytest.fixture(scope="module")
def modules() -> dict[str, Module]:
    gen = torch.Generator().manual_seed(0)
    return {name: Module(name, gen) for name in MODULES}


SLOT_RANKS = torch.tensor(RANKS, dtype=torch.int32)
SLOT_SCALINGS = torch.tensor(SCALINGS, dtype=torch.float32)


class Setup:
    """A backend with its module kinds registered, and each module's weights in its layout."""

    def __init__(self, backend, modules: dict[str, Module], fold: bool) -> None:
        self.backend = backend
        self.layers = {n: (m.folded() if fold else m.plain()) for n, m in modules.items()}
        backend.init_modules({n: w.spec for n, (w, _) in self.layers.items()}, SLOT_RANKS, SLOT_SCALINGS,
                             torch.float32)

    def run(self, x: torch.Tensor, inter: torch.Tensor) -> dict[str, torch.Tensor]:
        """The module calls of a decoder layer (qkv and gate_up read x, down reads inter)."""
        return {n: self.backend.run_module(w, base, inter if n == "down_proj" else x) for n, (w, base) in self.layers.items()}


BACKENDS = {"triton": TokenLoRABackend, "csgmv": ChunkedSgmvLoRABackend}
CONFIGS = [(name, fold) for name in BACKENDS for fold in (True, False)]


def make(name: str, fold: bool, modules) -> Setup:
    return Setup(BACKENDS[name](NUM_SLOTS, "cpu"), modules, fold)


def inputs(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Row t gets the same values whatever the row count (padded replays compare row-wise).
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(MAX_ROWS, HIDDEN, generator=gen)[:rows].clone(), torch.randn(MAX_ROWS, INTER, generator=gen)[:rows].clone()


def reference(modules, slots, seq_lens, x, inter, mode=ForwardMode.EXTEND):
    ref = Setup(TorchNativeLoRABackend(NUM_SLOTS, "cpu"), modules, fold=False)
    ref.backend.fill_batch_info(make_batch(seq_lens, mode), slots, RANKS, SCALINGS, ForwardPath.EAGER)
    return ref.run(x, inter)


def assert_outputs_close(got, expected, rows: int | None = None):
    for name in expected:
        g = got[name] if rows is None else got[name][:rows]
        torch.testing.assert_close(g, expected[name][: g.shape[0]], rtol=1e-4, atol=1e-4, msg=name)


MIXED_SLOTS = [A_SLOT, BASE_SLOT, B_SLOT, A_SLOT]
MIXED_LENS = [5, 3, 50, 9]


@pytest.mark.parametrize("name,fold", CONFIGS)
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_eager_matches_torch_native(name, fold, mode, modules):
    lens = MIXED_LENS if mode.is_extend() else [1] * 4
    x, inter = inputs(sum(lens), seed=2)
    setup = make(name, fold, modules)
    setup.backend.fill_batch_info(make_batch(lens, mode), MIXED_SLOTS, RANKS, SCALINGS, ForwardPath.EAGER)
    got = setup.run(x, inter)
    expected = reference(modules, MIXED_SLOTS, lens, x, inter, mode)
    assert_outputs_close(got, expected)
    # The adapters did something and the base request did not.
    plain = reference(modules, [BASE_SLOT] * 4, lens, x, inter, mode)
    base_rows = slice(lens[0], lens[0] + lens[1])
    torch.testing.assert_close(got["qkv_proj"][base_rows], plain["qkv_proj"][base_rows], rtol=0, atol=1e-5)
    assert not torch.allclose(got["qkv_proj"][: lens[0]], plain["qkv_proj"][: lens[0]])


def test_csgmv_unfolded_all_base_adds_nothing(modules):
    setup = make("csgmv", False, modules)
    setup.backend.fill_batch_info(make_batch([4, 2]), [BASE_SLOT, 3], RANKS, SCALINGS, ForwardPath.EAGER)
    info = setup.backend.batch_info
    # One inactive segment over the six rows, under a rank-0 slot: every kernel program returns.
    assert info.bs == 1 and RANKS[int(info.weight_indices[0])] == 0
    x, inter = inputs(6, seed=3)
    assert_outputs_close(setup.run(x, inter), reference(modules, [BASE_SLOT, 3], [4, 2], x, inter))


# ---- static infos -----------------------------------------------------------------------------
@contextlib.contextmanager
def replaying(backend, captured):
    """What a graph replay runs: the launches (and csgmv's segment grid) recorded at capture, on
    the static metadata as the latest refresh left it."""
    info = backend.batch_info
    live = (info.num_rows, info.bs, info.max_len, backend._launches)
    info.num_rows, info.bs, info.max_len, backend._launches = captured
    try:
        yield
    finally:
        info.num_rows, info.bs, info.max_len, backend._launches = live


def capture(backend, fb) -> tuple:
    info = backend.batch_info
    assert info.use_cuda_graph
    return info.num_rows, info.bs, info.max_len, backend._launches


# A large batch first (fills many rows / segments), then smaller ones: stale tails must not re-apply.
PREFILL_SEQUENCE = [
    ([A_SLOT, B_SLOT, BASE_SLOT, B_SLOT, A_SLOT, A_SLOT, B_SLOT], [9, 17, 4, 6, 11, 2, 7]),
    (MIXED_SLOTS, [5, 3, 10, 4]),
    ([B_SLOT], [3]),
    ([BASE_SLOT, BASE_SLOT], [6, 1]),  # all-base batch after adapter batches
]


@pytest.mark.parametrize("name,fold", CONFIGS)
def test_prefill_static_info_matches_eager(name, fold, modules):
    bucket = 64
    setup, eager = make(name, fold, modules), make(name, fold, modules)
    backend = setup.backend
    backend.init_prefill_cuda_graph_batch_info(max_num_tokens=bucket)
    assert backend.prefill_cuda_graph_max_tokens == backend.prefill_cuda_graph_max_bs == bucket
    zeros = [0] * NUM_SLOTS
    backend.fill_batch_info(make_batch([bucket]), [BASE_SLOT], zeros, [0.0] * NUM_SLOTS, ForwardPath.PREFILL_GRAPH)
    captured = capture(backend, None)
    for step, (slots, lens) in enumerate(PREFILL_SEQUENCE):
        live = sum(lens)
        x, inter = inputs(live, seed=10 + step)
        backend.fill_batch_info(make_batch(lens), slots, RANKS, SCALINGS, ForwardPath.PREFILL_GRAPH)
        assert backend.batch_info is backend.prefill_cuda_graph_batch_info
        eager.backend.fill_batch_info(make_batch(lens), slots, RANKS, SCALINGS, ForwardPath.EAGER)
        expected = eager.run(x, inter)
        assert_outputs_close(expected, reference(modules, slots, lens, x, inter))
        # Eager consumption of the in-place info is valid too, and adds the same bits.
        in_place = setup.run(x, inter)
        for key in expected:
            assert torch.equal(in_place[key], expected[key]), key
        padded_x, padded_inter = inputs(bucket, seed=10 + step)
        with replaying(backend, captured):
            replayed = setup.run(padded_x, padded_inter)
        assert_outputs_close(replayed, expected, rows=live)
        # Padding rows (slot -1) get nothing added: the base output.
        untouched = reference(modules, [BASE_SLOT], [bucket], padded_x, padded_inter)
        for key in replayed:
            torch.testing.assert_close(replayed[key][live:], untouched[key][live:], rtol=0, atol=1e-5, msg=key)


@pytest.mark.parametrize("name,fold", CONFIGS)
def test_decode_static_info_matches_eager(name, fold, modules):
    max_bs = 8
    setup = make(name, fold, modules)
    backend = setup.backend
    backend.init_cuda_graph_batch_info(max_bs, 1)
    assert backend.max_bs_in_cuda_graph == max_bs
    batch = make_batch([1] * max_bs, ForwardMode.DECODE)
    backend.fill_batch_info(batch, [BASE_SLOT] * max_bs, [0] * NUM_SLOTS, [0.0] * NUM_SLOTS, ForwardPath.DECODE_GRAPH)
    captured = capture(backend, batch)
    for slots in ([A_SLOT, B_SLOT, A_SLOT, BASE_SLOT, B_SLOT, B_SLOT, A_SLOT, A_SLOT], [B_SLOT, BASE_SLOT, A_SLOT], [BASE_SLOT]):
        bs = len(slots)
        x, inter = inputs(bs, seed=bs)
        backend.fill_batch_info(make_batch([1] * bs, ForwardMode.DECODE), slots, RANKS, SCALINGS, ForwardPath.DECODE_GRAPH)
        assert backend.batch_info is backend.cuda_graph_batch_info
        expected = reference(modules, slots, [1] * bs, x, inter, ForwardMode.DECODE)
        assert_outputs_close(setup.run(x, inter), expected)
        with replaying(backend, captured):
            replayed = setup.run(*inputs(max_bs, seed=bs))
        assert_outputs_close(replayed, expected, rows=bs)


@pytest.mark.parametrize("name", ["csgmv", "triton"])
def test_decode_refresh_skips_an_unchanged_batch(name, modules, monkeypatch):
    """A decode step whose batch (slots, lengths, slot ranks) is the last refresh's copies nothing:
    its metadata is in the static buffer already. Any change in between, a slot rank included,
    rewrites it, and every refresh reads as a fresh build of its batch would."""
    backend = make(name, True, modules).backend
    backend.init_cuda_graph_batch_info(8, 1)
    meta = backend._decode
    writes = []
    real_write = meta.staging.write
    monkeypatch.setattr(meta.staging, "write", lambda values: (writes.append(1), real_write(values)))
    info = backend.cuda_graph_batch_info

    def refresh(slots, ranks=RANKS):
        backend.fill_batch_info(make_batch([1] * len(slots), ForwardMode.DECODE), slots, ranks, SCALINGS,
                                ForwardPath.DECODE_GRAPH)
        return _segments_of(info), info.num_segments, info.num_rows

    a = [A_SLOT, B_SLOT, A_SLOT, BASE_SLOT]
    b = [B_SLOT, B_SLOT, A_SLOT]
    assert (backend.metadata_refreshes, backend.metadata_writes) == (0, 0)
    first = refresh(a)
    assert refresh(a) == first and len(writes) == 1  # unchanged: nothing copied
    other = refresh(b)
    assert other != first and len(writes) == 2
    assert refresh(a) == first and len(writes) == 3  # back to a: rebuilt, the same as the first time
    no_b = [r if s != B_SLOT else 0 for s, r in enumerate(RANKS)]  # B's slot emptied: its rows go inactive
    emptied = refresh(a, no_b)
    assert len(writes) == 4 and all(slot != B_SLOT for slot, _ in emptied[0])
    assert (backend.metadata_refreshes, backend.metadata_writes) == (5, 4)  # what /get_server_info reports
    fresh = make(name, True, modules).backend
    fresh.init_cuda_graph_batch_info(8, 1)
    fresh.fill_batch_info(make_batch([1] * 4, ForwardMode.DECODE), a, no_b, SCALINGS, ForwardPath.DECODE_GRAPH)
    assert (_segments_of(fresh.cuda_graph_batch_info), fresh.cuda_graph_batch_info.num_segments) == emptied[:2]


def test_rowwise_decode_bound_parses_its_values():
    from sglang.srt.lora.backend.token_backend import ROWWISE_SMALL_ROWS, rowwise_decode_bound

    assert rowwise_decode_bound("0") is None and rowwise_decode_bound("1") >= 1 << 20
    assert rowwise_decode_bound("small") == ROWWISE_SMALL_ROWS == 16
    assert rowwise_decode_bound("rows:32") == 32
    for bad in ("yes", "rows:0", "rows:-4", "rows:", "32"):
        with pytest.raises(ValueError, match=f"SGLANG_LORA_ROWWISE_DECODE={bad!r}"):
            rowwise_decode_bound(bad)


@pytest.mark.parametrize("name", ["csgmv", "triton"])
def test_rowwise_small_decides_by_the_graph_bucket(name, modules, monkeypatch):
    """SGLANG_LORA_ROWWISE_DECODE=small, the default (unset): decode batches whose graph bucket has
    at most 16 rows take the row-wise o_proj / down_proj kernels (decided at the bucket, so a live
    batch and the bucket it replays agree), others and every prefill the segments; the outputs are
    the module's."""
    monkeypatch.delenv("SGLANG_LORA_ROWWISE_DECODE", raising=False)
    setup = make(name, True, modules)
    backend = setup.backend
    assert backend.rowwise_decode
    backend.enable_norm_fusion()
    backend.init_cuda_graph_batch_info(24, 1, buckets=[4, 12, 24])
    assert [backend.rowwise_fits(n) for n in (1, 4, 5, 12, 13, 24, 40)] == [True] * 4 + [False] * 3

    def fill(slots, path, mode=ForwardMode.DECODE):
        lens = [1] * len(slots) if mode == ForwardMode.DECODE else [3] * len(slots)
        backend.fill_batch_info(make_batch(lens, mode), slots, RANKS, SCALINGS, path)
        return backend.rowwise_now()

    small = [A_SLOT, B_SLOT, BASE_SLOT, A_SLOT, B_SLOT]
    assert fill(small, ForwardPath.DECODE_GRAPH) and fill(small, ForwardPath.EAGER)  # bucket 12
    assert not fill([A_SLOT, B_SLOT] * 7, ForwardPath.DECODE_GRAPH)  # 14 rows: bucket 24
    assert not fill(small, ForwardPath.EAGER, ForwardMode.EXTEND)
    fill(small, ForwardPath.EAGER)
    x, inter = inputs(len(small), seed=9)
    assert_outputs_close(setup.run(x, inter), reference(modules, small, [1] * 5, x, inter, ForwardMode.DECODE))


def test_staged_copy_rewrites_its_tensor_in_place():
    from sglang.srt.lora.backend._staging import StagedCopy

    dst = torch.zeros(5, dtype=torch.int32)
    staged = StagedCopy(dst)
    ptr = dst.data_ptr()
    for values in ([1, 2, 3, 4, 5], [9, 8, 7, 6, 5]):
        staged.write(torch.tensor(values, dtype=torch.int32))
        assert dst.tolist() == values and dst.data_ptr() == ptr
    with pytest.raises(AssertionError):
        staged.write(torch.zeros(4, dtype=torch.int32))


def _segments_of(info) -> list[tuple[int, list[int]]]:
    """(slot, token rows) of every non-empty segment of an info, as the kernels read them."""
    indptr, slots, perm = info.seg_indptr.tolist(), info.weight_indices.tolist(), info.permutation.tolist()
    return [(slots[i], perm[indptr[i] : indptr[i + 1]]) for i in range(info.bs) if indptr[i + 1] > indptr[i]]


def test_token_major_static_segments_and_no_request_cap(modules):
    setup = make("triton", True, modules)
    backend = setup.backend
    backend.init_prefill_cuda_graph_batch_info(max_num_tokens=64)
    info = backend.prefill_cuda_graph_batch_info
    assert info.permutation.numel() == 64 and info.use_cuda_graph
    assert info.lora_ranks is SLOT_RANKS and info.scalings is SLOT_SCALINGS  # the pool's tensors, not copies
    buffers = [t.data_ptr() for t in (info.permutation, info.seg_indptr, info.weight_indices)]
    backend.fill_batch_info(make_batch([3, 2], pad_to=16), [A_SLOT, B_SLOT], RANKS, SCALINGS, ForwardPath.PREFILL_GRAPH)
    assert info.num_rows == 16 and info.bs == segment_capacity(16, 16, NUM_SLOTS)
    # Every row of the graph kind in exactly one segment: A, B, then the rest under a rank-0 slot.
    segs = _segments_of(info)
    assert segs[:2] == [(A_SLOT, [0, 1, 2]), (B_SLOT, [3, 4])]
    assert all(RANKS[slot] == 0 and len(rows) <= 16 for slot, rows in segs[2:])
    assert sorted(r for _, rows in segs for r in rows) == list(range(64))
    # 48 one-token requests fit a 64-token bucket (the old triton backend stopped at 32); the
    # interleaved rows are regrouped into one-slot segments.
    backend.fill_batch_info(make_batch([1] * 48), [A_SLOT, BASE_SLOT] * 24, RANKS, SCALINGS, ForwardPath.PREFILL_GRAPH)
    segs = _segments_of(info)
    assert segs[:2] == [(A_SLOT, list(range(0, 32, 2))), (A_SLOT, list(range(32, 48, 2)))]
    assert [t.data_ptr() for t in (info.permutation, info.seg_indptr, info.weight_indices)] == buffers
    x, inter = inputs(48, seed=5)
    assert_outputs_close(setup.run(x, inter), reference(modules, [A_SLOT, BASE_SLOT] * 24, [1] * 48, x, inter))


@pytest.mark.parametrize("name", ["csgmv", "triton"])
def test_static_tail_is_neutralised(name, modules):
    backend = make(name, False, modules).backend
    backend.init_prefill_cuda_graph_batch_info(max_num_tokens=64)
    info = backend.prefill_cuda_graph_batch_info
    assert info.bs == segment_capacity(64, 16, NUM_SLOTS) and info.max_len == 16
    slots, lens = PREFILL_SEQUENCE[0]
    backend.fill_batch_info(make_batch(lens), slots, RANKS, SCALINGS, ForwardPath.PREFILL_GRAPH)
    backend.fill_batch_info(make_batch([3]), [B_SLOT], RANKS, SCALINGS, ForwardPath.PREFILL_GRAPH)
    assert info.bs == segment_capacity(3, 16, NUM_SLOTS)  # the grid's segment axis follows the rows (3)
    indptr = info.seg_indptr.tolist()
    assert indptr[:2] == [0, 3] and info.weight_indices.tolist()[0] == B_SLOT
    # Past the live segments: one inactive run over the padding rows, then empty segments only.
    assert all(RANKS[s] == 0 for s in info.weight_indices.tolist()[1:])
    assert indptr[info.num_segments :] == [64] * (len(indptr) - info.num_segments)


# ---- host-side pieces -------------------------------------------------------------------------
def test_csgmv_chunks_are_the_same_eagerly_and_under_graphs(modules):
    backend = ChunkedSgmvLoRABackend(NUM_SLOTS, "cpu", max_lora_chunk_size=32)
    Setup(backend, modules, fold=False)
    backend.fill_batch_info(make_batch(MIXED_LENS), MIXED_SLOTS, RANKS, SCALINGS, ForwardPath.EAGER)
    info = backend.batch_info
    assert info.max_len == 32
    # A: 5 + 9 = 14 tokens -> 1 chunk; B: 50 tokens -> 2 chunks; base: one inactive chunk.
    assert info.weight_indices.tolist() == [A_SLOT, B_SLOT, B_SLOT, BASE_SLOT]
    assert info.seg_indptr.tolist() == [0, 14, 46, 64, 67]
    assert info.bs == info.num_segments == 4
    backend.init_prefill_cuda_graph_batch_info(max_num_tokens=128)
    assert backend.prefill_cuda_graph_batch_info.max_len == 32


def test_build_segments_sorts_stably_and_puts_inactive_rows_last():
    segs = build_segments([A_SLOT, BASE_SLOT, B_SLOT, A_SLOT], [3, 2, 20, 2], RANKS, chunk=16, num_rows=30,
                          idle_slot=BASE_SLOT)
    perm = segs.permutation.tolist()
    assert sorted(perm) == list(range(30))
    # A's tokens (rows 0-2, 25-26) in order, then B's (5-24), then base rows (3-4) and padding.
    assert perm == [0, 1, 2, 25, 26] + list(range(5, 25)) + [3, 4] + list(range(27, 30))
    assert segs.seg_indptr == [0, 5, 21, 25, 30] and segs.weight_indices == [A_SLOT, B_SLOT, B_SLOT, BASE_SLOT]
    assert segs.num_active_rows == 25
    # Decode: one row per request, interleaved slots regrouped; -1 and rank-0 slots are inactive.
    segs = build_segments([B_SLOT, -1, A_SLOT, BASE_SLOT, B_SLOT], [1] * 5, RANKS, chunk=16, num_rows=5,
                          idle_slot=BASE_SLOT)
    assert segs.permutation.tolist() == [2, 0, 4, 1, 3]
    assert segs.seg_indptr == [0, 1, 3, 5] and segs.weight_indices == [A_SLOT, B_SLOT, BASE_SLOT]
    # A decode batch said to be one: the same segments, padding rows included; none at all.
    told = build_segments([B_SLOT, -1, A_SLOT, BASE_SLOT, B_SLOT], [1] * 5, RANKS, chunk=16, num_rows=8,
                          idle_slot=BASE_SLOT, one_row_each=True)
    assert told.permutation.tolist() == [2, 0, 4, 1, 3, 5, 6, 7] and told.permutation.dtype == torch.int32
    assert told.seg_indptr == [0, 1, 3, 8] and told.weight_indices == [A_SLOT, B_SLOT, BASE_SLOT]
    empty = build_segments([], [], RANKS, chunk=16, num_rows=0, idle_slot=BASE_SLOT, one_row_each=True)
    assert empty.permutation.numel() == 0 and empty.num_segments == 0


def test_segment_capacity_bounds_every_batch():
    """Any batch of n rows takes at most segment_capacity(n) segments, and a bucket's first
    segment_capacity(B) segments of a static plan hold every row < B."""
    import random

    rng = random.Random(0)
    ranks = [0, 8, 16, 4, 0, 2]
    for _ in range(300):
        bs = rng.randint(1, 12)
        lens = [rng.choice([0, 1, 1, 3, 17, 40]) for _ in range(bs)]
        slots = [rng.randrange(-1, len(ranks)) for _ in range(bs)]
        chunk = rng.choice([16, 32])
        live = sum(lens)
        bucket = live + rng.randint(0, 40)
        static_rows = bucket + rng.randint(0, 100)
        segs = build_segments(slots, lens, ranks, chunk, static_rows, idle_slot=0)
        cap = segment_capacity(bucket, chunk, len(ranks))
        covered = {r for i in range(min(cap, segs.num_segments))
                   for r in segs.permutation[segs.seg_indptr[i] : segs.seg_indptr[i + 1]].tolist()}
        assert set(range(bucket)) <= covered
        assert build_segments(slots, lens, ranks, chunk, live, 0).num_segments <= segment_capacity(live, chunk,
                                                                                                   len(ranks))


def test_registry_and_capabilities():
    assert get_backend_from_name("triton") is TokenLoRABackend
    assert get_backend_from_name("csgmv") is ChunkedSgmvLoRABackend
    assert get_backend_from_name("torch_native") is TorchNativeLoRABackend
    assert TokenLoRABackend.supports_prefill_cuda_graph and ChunkedSgmvLoRABackend.supports_prefill_cuda_graph
    assert TokenLoRABackend.supports_fold and ChunkedSgmvLoRABackend.supports_fold
    assert not TorchNativeLoRABackend.supports_prefill_cuda_graph and not TorchNativeLoRABackend.supports_fold
    with pytest.raises(ValueError, match="csgmv, torch_native, triton"):
        get_backend_from_name("punica")
    native = TorchNativeLoRABackend(NUM_SLOTS, "cpu")
    with pytest.raises(ValueError):
        native.fill_batch_info(make_batch([2]), [A_SLOT], RANKS, SCALINGS, ForwardPath.PREFILL_GRAPH)
    with pytest.raises(NotImplementedError):
        native.init_prefill_cuda_graph_batch_info(64)
