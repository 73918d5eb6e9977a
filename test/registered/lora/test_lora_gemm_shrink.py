"""The GEMM shrink of folded modules at long prefills (triton_ops/gemm_shrink.py,
SGLANG_LORA_GEMM_SHRINK). CPU, TRITON_INTERPRET=1, float32.

The kernel: x_aug's E columns equal shrink_pack's (to float32 rounding: one GEMM against every
slot in place of the segments' own reductions), every column written (NaN poison disappears; A
past an adapter's compact prefix is NaN and never read), rows of a graph bucket past the live
batch get zeros. Through the model: prefills take it (triton and csgmv), and the run equals the
default's to float32 rounding."""

from __future__ import annotations

import pytest
import torch

from lora_testlib import two_adapter_assets
from sglang.srt.lora.fold import fold_extra_columns
from sglang.srt.lora.segments import segment_capacity
from sglang.srt.lora.triton_ops.gemm_shrink import gemm_shrink_pack, gemm_shrink_width
from sglang.srt.lora.triton_ops.token_lora import plan_pack, prepare_pack, token_segments

R = 16
# The pool's layout: adapter slots first, the base model's (rank 0, no block in E) last.
RANKS = [8, 16, 5, 0, 0]  # slot 2: a rank not a multiple of 16; slot 3: empty; slot 4: the base
SCALINGS = [0.5, 2.0, 1.25, 0.0, 0.0]
FOLD_SLOTS = len(RANKS) - 1
ROW_SLOTS = [0] * 5 + [1] * 11 + [1] * 3 + [4] * 3 + [2] * 4 + [0, 4, 2, 1, 0] + [3, 3]


def _poisoned_a(stack: int, in_dim: int, gen) -> torch.Tensor:
    a = torch.randn(len(RANKS), stack * R, in_dim, generator=gen)
    for slot, r in enumerate(RANKS):
        a[slot, stack * r:] = float("nan")  # past the adapter's compact prefix: never read
    return a


def _segments(row_slots: list[int], capacity: int | None = None):
    ranks = torch.tensor(RANKS, dtype=torch.int32)
    perm, indptr, slots, n = token_segments(torch.tensor(row_slots, dtype=torch.int32), ranks, 16)
    if capacity is not None:  # a graph bucket's grid: empty segments past the live ones
        indptr = torch.cat([indptr, indptr[-1:].expand(capacity - n)])
        slots = torch.cat([slots, torch.full((capacity - n,), len(RANKS) - 1, dtype=torch.int32)])
        n = capacity
    return perm, indptr, slots, n


@pytest.mark.parametrize("stack,in_dim", [(1, 40), (2, 300), (3, 300)])
def test_gemm_shrink_pack_matches_shrink_pack(stack, in_dim):
    gen = torch.Generator().manual_seed(stack)
    rows = len(ROW_SLOTS)
    x = torch.randn(rows, in_dim, generator=gen)
    a = _poisoned_a(stack, in_dim, gen)
    ranks, scalings = torch.tensor(RANKS, dtype=torch.int32), torch.tensor(SCALINGS)
    extra = fold_extra_columns(FOLD_SLOTS, stack, R) + 16  # more alignment padding than the pool adds
    perm, indptr, slots, n = _segments(ROW_SLOTS)

    expected = torch.full((rows, in_dim + extra), float("nan"))
    expected[:, :in_dim] = x
    plan = plan_pack(in_dim, stack, R, extra, 4)
    workspace = torch.empty(max(1, plan.shrink.workspace_numel(rows)))
    counters = torch.zeros(max(1, plan.shrink.num_counters(n)), dtype=torch.int32)
    prepare_pack(plan, rows, n, expected[:, :in_dim], a, expected.stride(0), copy_x=False)(
        expected[:, :in_dim], a, expected, workspace, counters, perm, indptr, slots, ranks, scalings)

    x_aug = torch.full((rows, in_dim + extra), float("nan"))
    x_aug[:, :in_dim] = x
    y = torch.empty(rows, gemm_shrink_width(FOLD_SLOTS, stack, R))
    gemm_shrink_pack(x_aug, in_dim, a, y, perm, indptr, slots, ranks, scalings, stack, R, FOLD_SLOTS, n, 16)
    assert not torch.isnan(x_aug).any()
    assert torch.equal(x_aug[:, :in_dim], x)  # x is left as it was
    values = expected[:, in_dim:] != 0
    assert torch.equal(x_aug[:, in_dim:] != 0, values)  # the same columns hold values, the rest zeros
    # Float32 sums of in_dim products in two orders (a BLAS GEMM, whose kernel and order depend on the
    # host's CPU, against the interpreted shrink_pack): 1.1e-5 apart on an AVX-512 host.
    torch.testing.assert_close(x_aug, expected, rtol=1e-5, atol=5e-5)


def test_gemm_shrink_pack_on_a_bucket_grid():
    """A graph replays the bucket's rows: padding rows (the base slot) after the live ones and
    empty segments past the live ones. The live rows are the eager bits; the padding rows' E is zero."""
    gen = torch.Generator().manual_seed(11)
    stack, in_dim = 3, 200
    live, pad = len(ROW_SLOTS), 9
    x = torch.randn(live + pad, in_dim, generator=gen)
    a = _poisoned_a(stack, in_dim, gen)
    ranks, scalings = torch.tensor(RANKS, dtype=torch.int32), torch.tensor(SCALINGS)
    extra = fold_extra_columns(FOLD_SLOTS, stack, R)
    cols = gemm_shrink_width(FOLD_SLOTS, stack, R)

    eager = torch.full((live, in_dim + extra), float("nan"))
    eager[:, :in_dim] = x[:live]
    perm, indptr, slots, n = _segments(ROW_SLOTS)
    gemm_shrink_pack(eager, in_dim, a, torch.empty(live, cols), perm, indptr, slots, ranks, scalings, stack, R,
                     FOLD_SLOTS, n, 16)

    replay = torch.full((live + pad, in_dim + extra), float("nan"))
    replay[:, :in_dim] = x
    capacity = segment_capacity(live + pad, 16, len(RANKS))
    perm, indptr, slots, n = _segments(ROW_SLOTS + [len(RANKS) - 1] * pad, capacity)
    gemm_shrink_pack(replay, in_dim, a, torch.empty(live + pad, cols), perm, indptr, slots, ranks, scalings, stack,
                     R, FOLD_SLOTS, n, 16)
    assert torch.equal(replay[:live], eager)
    assert torch.equal(replay[live:, in_dim:], torch.zeros(pad, extra))


# ---------------------------------------------------------------------------- through the model
PROMPTS = [[5, 9, 13, 200, 7, 3, 99], [11, 4, 250], [17, 18, 19, 20, 21], [300, 2, 8, 8]]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return two_adapter_assets(tmp_path_factory.mktemp("gemm-shrink"))


def _run(assets, backend: str, gemm_shrink: str, monkeypatch, **overrides) -> tuple[list, torch.Tensor, list]:
    """Prefill the prompts on adapters a, base, b, a, then three greedy decode steps: the tokens,
    the decode logprobs and the GEMM shrinks that ran (each its module's output slices)."""
    from helpers import EngineDriver, make_runner
    from sglang.srt.layers.triton_ops.dispatch import fused_kernels
    from sglang.srt.lora.backend import token_backend

    ckpt, paths = assets
    monkeypatch.setenv("SGLANG_LORA_GEMM_SHRINK", gemm_shrink)
    # csgmv's qkv_proj takes the A-fold at short prefills (SGLANG_LORA_AFOLD_QKV) and so no shrink
    # of its own: off here, so that qkv_proj's GEMM shrink is what these short prefills test.
    monkeypatch.setenv("SGLANG_LORA_AFOLD_QKV", "0")
    runner = make_runner(ckpt, lora_paths=[f"{n}={p}" for n, p in paths.items()], lora_backend=backend,
                         max_lora_rank=8, **overrides)
    monkeypatch.delenv("SGLANG_LORA_GEMM_SHRINK")
    monkeypatch.delenv("SGLANG_LORA_AFOLD_QKV")
    calls = []
    original = token_backend.gemm_shrink_pack
    # Each call's module: its number of output slices (qkv_proj 3, gate_up_proj 2, down_proj 1).
    monkeypatch.setattr(token_backend, "gemm_shrink_pack", lambda *a, **kw: calls.append(a[9]) or original(*a, **kw))
    ids = {r.lora_name: i for i, r in runner.lora_manager.refs.items()}
    driver = EngineDriver(runner)
    seqs = [driver.add(p, lora_id=ids.get(n)) for p, n in zip(PROMPTS, ("a", None, "b", "a"))]
    tokens, logprobs = [], []
    with fused_kernels("triton"):
        out = driver.extend(seqs)
        for _ in range(3):
            for seq, t in zip(seqs, out.next_token_ids.tolist()):
                seq.tokens.append(t)
            out = driver.decode(seqs, return_logprob=True)
            tokens.append(out.next_token_ids.tolist())
            logprobs.append(out.next_token_logprobs)
    monkeypatch.undo()
    return tokens, torch.tensor(logprobs, dtype=torch.float64), calls


@pytest.mark.parametrize("backend", ["triton", "csgmv"])
def test_prefills_take_the_gemm_shrink_and_decode_the_same(assets, backend, monkeypatch):
    tokens, logprobs, calls = _run(assets, backend, "1", monkeypatch)
    ref_tokens, ref_logprobs, ref_calls = _run(assets, backend, "0", monkeypatch)
    # The prefill's in-place folded modules (qkv_proj and gate_up_proj of every layer, and down_proj
    # where no A-fold takes it); never at decode, never with the setting off.
    assert len(calls) >= 4 and ref_calls == []
    assert tokens == ref_tokens
    torch.testing.assert_close(logprobs, ref_logprobs, rtol=0, atol=1e-4)


def test_a_bound_past_the_prefill_keeps_shrink_pack(assets, monkeypatch):
    _, _, calls = _run(assets, "csgmv", "tokens:64", monkeypatch)  # the prefill holds 19 tokens
    assert calls == []


def test_more_slots_than_the_bound_keep_shrink_pack(assets, monkeypatch):
    """The GEMM does every slot's work: past GEMM_SHRINK_MAX_SLOTS adapter slots it stays off, and
    a one-slice module (down_proj, over the long intermediate K) stops at half as many."""
    from sglang.srt.lora.triton_ops.gemm_shrink import GEMM_SHRINK_MAX_SLOTS

    _, _, calls = _run(assets, "triton", "1", monkeypatch, max_loras_per_batch=GEMM_SHRINK_MAX_SLOTS // 2)
    assert 1 in calls and 2 in calls and 3 in calls
    _, _, calls = _run(assets, "triton", "1", monkeypatch, max_loras_per_batch=GEMM_SHRINK_MAX_SLOTS)
    assert 1 not in calls and 2 in calls and 3 in calls
    _, _, calls = _run(assets, "csgmv", "1", monkeypatch, max_loras_per_batch=GEMM_SHRINK_MAX_SLOTS + 1)
    assert calls == []
