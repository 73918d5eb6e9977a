"""LoRA folded into the base GEMM (lora/fold.py, triton_ops/shrink_pack.py, the pool's W_aug layout).

CPU, TRITON_INTERPRET=1, float32. The kernel is checked against a torch reference of the whole
x_aug row by row (every column is written: NaN poison in the output must disappear), with slots
mixed within a tile, rank-0 and padding rows (slot -1), ranks below R, alignment padding of E, and
split-K (counters re-armed: a second launch is bit-identical). The pool tests check that loading
writes only the diagonal blocks, that a smaller adapter moving into a slot leaves no residue in
W_aug, and that the base weight is a view of W_aug. PEFT parity through the whole model runs
with the fold forced on and off.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from sglang.srt.lora.fold import FOLD_MAX_EXTRA_BYTES, fold_extra_columns, fold_weight, should_fold
from sglang.srt.lora.triton_ops.token_lora import plan_pack, shrink_pack, with_split

S, R = 4, 16
RANKS = [0, 8, 16, 5]  # slot 0: the base model; slot 3: a rank not a multiple of 16
SCALINGS = [0.0, 0.5, 2.0, 1.25]
RANKS_T = torch.tensor(RANKS, dtype=torch.int32)
SCALINGS_T = torch.tensor(SCALINGS)
# Per-row slots: whole tiles of one slot, a tile mixing three slots and a base row, padding (-1).
ROW_SLOTS = [1] * 5 + [2] * 11 + [2] * 3 + [0] * 3 + [3] * 4 + [1, 0, 3, 2, 1] + [-1] * 4


def _poisoned_a(stack: int, in_dim: int, gen) -> torch.Tensor:
    a = torch.randn(S, stack * R, in_dim, generator=gen)
    for slot, r in enumerate(RANKS):
        a[slot, stack * r :] = float("nan")  # past the adapter's compact prefix: never read
    return a


def ref_x_aug(x, a, slots, stack, extra) -> torch.Tensor:
    """[x | packed pre-scaled shrink]: slot s's block at s*c*R, slice k's rank columns at k*R."""
    rows, in_dim = x.shape
    out = torch.zeros(rows, in_dim + extra)
    out[:, :in_dim] = x
    for t, s in enumerate(slots):
        if s < 0 or RANKS[s] == 0:
            continue
        r = RANKS[s]
        xa = SCALINGS[s] * (x[t] @ a[s, : stack * r].T)
        for k in range(stack):
            col = in_dim + s * stack * R + k * R
            out[t, col : col + r] = xa[k * r : (k + 1) * r]
    return out


@pytest.mark.parametrize("stack", [1, 2, 3])
@pytest.mark.parametrize("in_dim,split", [(40, 1), (300, 2), (300, 3)])
def test_shrink_pack_writes_every_column(stack, in_dim, split):
    gen = torch.Generator().manual_seed(10 * stack + split)
    slots = torch.tensor(ROW_SLOTS, dtype=torch.int32)
    rows = slots.numel()
    x = torch.randn(rows, in_dim, generator=gen)
    a = _poisoned_a(stack, in_dim, gen)
    extra = fold_extra_columns(S, stack, R) + 16  # more alignment padding than the pool would add
    plan = plan_pack(in_dim, stack, R, extra, 4)
    plan = dataclasses.replace(plan, shrink=with_split(plan.shrink, split))
    assert plan.shrink.split == split
    workspace = torch.full((max(plan.shrink.workspace_numel(rows), 1),), float("nan"))
    counters = torch.zeros(max(plan.shrink.num_counters(rows), 1), dtype=torch.int32)
    expected = ref_x_aug(x, a, ROW_SLOTS, stack, extra)
    outs = []
    for _ in range(2):
        x_aug = torch.full((rows, in_dim + extra), float("nan"))
        shrink_pack(x, a, x_aug, slots, RANKS_T, SCALINGS_T, stack, R, workspace, counters, plan)
        assert torch.equal(counters, torch.zeros_like(counters))  # re-armed for the next launch
        outs.append(x_aug)
    assert not torch.isnan(outs[0]).any()
    assert torch.equal(outs[0][:, :in_dim], x)  # the copy is exact
    torch.testing.assert_close(outs[0], expected, rtol=1e-5, atol=1e-4)
    assert torch.equal(outs[0], outs[1])


def test_shrink_pack_rows_do_not_depend_on_the_row_count():
    """A graph replays the bucket's rows (padding -1 after the live ones), eager runs the live rows
    only: each live row of x_aug must be the same bits (the plan ignores the row count)."""
    gen = torch.Generator().manual_seed(3)
    live = torch.tensor(ROW_SLOTS[:-4], dtype=torch.int32)
    bucket = torch.cat([live, torch.full((37,), -1, dtype=torch.int32)])
    x = torch.randn(bucket.numel(), 1100, generator=gen)
    a = _poisoned_a(3, 1100, gen)
    extra = fold_extra_columns(S, 3, R)
    eager = torch.empty(live.numel(), 1100 + extra)
    shrink_pack(x[: live.numel()], a, eager, live, RANKS_T, SCALINGS_T, 3, R)
    replay = torch.empty(bucket.numel(), 1100 + extra)
    shrink_pack(x, a, replay, bucket, RANKS_T, SCALINGS_T, 3, R)
    assert plan_pack(1100, 3, R, extra, 4).shrink.split > 1  # split-K on both paths
    assert torch.equal(replay[: live.numel()], eager)
    assert torch.equal(replay[live.numel() :, 1100:], torch.zeros(37, extra))


def test_shrink_pack_on_a_bucket_grid_leaves_rows_past_the_batch_alone():
    """A graph's grid spans the bucket's segment capacity: past the live segments come empty ones
    (start == end), and segments may reach rows past num_rows. Those programs return without a
    write, and the live rows are the eager bits."""
    from sglang.srt.lora.segments import segment_capacity
    from sglang.srt.lora.triton_ops.token_lora import prepare_pack, token_segments

    gen = torch.Generator().manual_seed(5)
    live = torch.tensor(ROW_SLOTS[:-4], dtype=torch.int32)
    n_live, bucket_rows, in_dim = live.numel(), live.numel() + 6, 300
    x = torch.randn(bucket_rows, in_dim, generator=gen)
    a = _poisoned_a(2, in_dim, gen)
    extra = fold_extra_columns(S, 2, R)
    plan = plan_pack(in_dim, 2, R, extra, 4)
    plan = dataclasses.replace(plan, shrink=with_split(plan.shrink, 2))
    eager = torch.full((n_live, in_dim + extra), float("nan"))
    shrink_pack(x[:n_live], a, eager, live, RANKS_T, SCALINGS_T, 2, R, plan=plan)
    # The bucket's segments: the live rows, then an inactive run over the padding rows.
    perm, indptr, slots, n_segs = token_segments(torch.cat([live, torch.full((6,), -1, dtype=torch.int32)]),
                                                 RANKS_T, plan.shrink.block_s)
    capacity = segment_capacity(bucket_rows, plan.shrink.block_s, S)
    assert capacity > n_segs
    indptr = torch.cat([indptr, indptr[-1:].expand(capacity - n_segs)])
    slots = torch.cat([slots, torch.zeros(capacity - n_segs, dtype=torch.int32)])  # the idle slot 0
    replay = torch.full((bucket_rows, in_dim + extra), float("nan"))
    workspace = torch.full((plan.shrink.workspace_numel(n_live),), float("nan"))
    counters = torch.zeros(plan.shrink.num_counters(capacity), dtype=torch.int32)
    launch = prepare_pack(plan, n_live, capacity, x, a, replay.stride(0))
    launch(x, a, replay, workspace, counters, perm, indptr, slots, RANKS_T, SCALINGS_T)
    assert torch.equal(replay[:n_live], eager)
    assert torch.isnan(replay[n_live:]).all()  # rows past the batch: not one write
    assert torch.equal(counters, torch.zeros_like(counters))


def test_folded_gemm_is_base_plus_lora():
    """F.linear(x_aug, W_aug) = x W^T + each row's scaling * (x A_k^T) B_k^T in slice k."""
    gen = torch.Generator().manual_seed(4)
    slices = (32, 16, 16)  # q, k, v under GQA
    in_dim, out_dim = 40, sum(slices)
    w = torch.randn(out_dim, in_dim, generator=gen)
    a = _poisoned_a(3, in_dim, gen)
    b = torch.randn(S, out_dim, R, generator=gen)
    w_aug, sliced = fold_weight(w, slices, S, R)
    for slot, r in enumerate(RANKS):
        sliced[slot][:, :r].copy_(b[slot, :, :r])
    slots = torch.tensor(ROW_SLOTS, dtype=torch.int32)
    x = torch.randn(slots.numel(), in_dim, generator=gen)
    x_aug = torch.empty(slots.numel(), w_aug.shape[1])
    out = F.linear(shrink_pack(x, a, x_aug, slots, RANKS_T, SCALINGS_T, 3, R), w_aug)
    expected = x @ w.T
    bounds = [(0, 32), (32, 48), (48, 64)]
    for t, s in enumerate(ROW_SLOTS):
        if s >= 0 and RANKS[s] > 0:
            r = RANKS[s]
            xa = x[t] @ a[s, : 3 * r].T
            for k, (lo, hi) in enumerate(bounds):
                expected[t, lo:hi] += SCALINGS[s] * (xa[k * r : (k + 1) * r] @ b[s, lo:hi, :r].T)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_sliced_b_views_write_only_diagonal_blocks():
    gen = torch.Generator().manual_seed(5)
    slices = (6, 2, 2)
    w = torch.randn(10, 8, generator=gen)
    w_aug, sliced = fold_weight(w, slices, 3, 4)
    assert w_aug.shape == (10, 8 + fold_extra_columns(3, 3, 4)) and (w_aug.shape[1] - 8) % 16 == 0
    assert torch.equal(w_aug[:, :8], w) and sliced.shape == (3, 10, 4) and sliced[1].shape == (10, 4)
    b = torch.randn(10, 3, generator=gen)
    sliced[1][:, :3].copy_(b)
    assert torch.equal(sliced[1].dense()[:, :3], b) and torch.equal(sliced[1].dense()[:, 3:], torch.zeros(10, 1))
    extra = w_aug[:, 8:]
    block = extra[:, 12:24]  # slot 1: c * R = 12 columns
    assert torch.equal(block[:6, 0:3], b[:6]) and torch.equal(block[6:8, 4:7], b[6:8]) and torch.equal(block[8:, 8:11], b[8:])
    expected_nonzero = 6 * 3 + 2 * 3 + 2 * 3
    assert int(torch.count_nonzero(extra)) == int(torch.count_nonzero(b)) <= expected_nonzero
    sliced[1][:, 1:3].zero_()
    assert int(torch.count_nonzero(extra)) == int(torch.count_nonzero(b[:, :1]))
    with pytest.raises(AssertionError):
        sliced[1][2:4, :]  # rows cross the slices' separate views


def test_fold_rule_bounds_the_extra_bytes():
    # Llama-8B, 9 slots, rank 16: every module folds; rank 64 leaves gate_up (and qkv) unfolded.
    e16 = {m: fold_extra_columns(9, c, 16) for m, c in (("qkv", 3), ("gate_up", 2), ("o", 1))}
    assert should_fold(6144, e16["qkv"], 2) and should_fold(28672, e16["gate_up"], 2) and should_fold(4096, e16["o"], 2)
    assert not should_fold(28672, fold_extra_columns(9, 2, 64), 2)
    assert not should_fold(6144, fold_extra_columns(9, 3, 64), 2) and should_fold(4096, fold_extra_columns(9, 1, 64), 2)
    assert 28672 * 365 * 2 <= FOLD_MAX_EXTRA_BYTES < 28672 * 366 * 2


# ---- the pool's folded layout -----------------------------------------------------------------
def test_pool_loads_into_w_aug_and_leaves_no_residue():
    from test_mem_pool import SHAPES, make_adapter

    from sglang.srt.lora.mem_pool import LoRAMemoryPool

    modules = ["qkv_proj", "gate_up_proj", "o_proj"]
    pool = LoRAMemoryPool(SHAPES, modules, 2, 8, torch.float32, "cpu", fold_candidates=["qkv_proj", "gate_up_proj"])
    assert pool.fold_modules == ["gate_up_proj", "qkv_proj"]  # tiny shapes: under the byte bound
    gen = torch.Generator().manual_seed(6)
    bases = {}
    for m in pool.fold_modules:
        for layer in range(SHAPES.num_layers):
            shape = SHAPES.modules[m]
            w = torch.randn(shape.out_dim, shape.in_dim, generator=gen)
            bases[m, layer] = w
            w_aug = pool.fold_base_weight(m, layer, w)
            assert torch.equal(w_aug[:, : shape.in_dim], w)
            # Blocks for the 2 adapter slots only: the base model's slot (rank 0) has none.
            assert w_aug.shape[1] - shape.in_dim == fold_extra_columns(2, len(shape.out_sizes), 8)
            assert pool.B_buffer[m][layer].shape[0] == pool.num_slots - 1 == 2
    assert isinstance(pool.B_buffer["o_proj"][0], torch.Tensor)  # not a candidate: plain buffer
    ptrs = pool.data_ptrs()
    big = make_adapter("big", r=8, modules=modules, seed=1)
    small = make_adapter("small", r=3, modules=["qkv_proj"], seed=2)
    ads = {"big": big, "small": small}
    pool.make_resident({"big"}, ads)
    big_slot = pool.get_slot("big")
    pool.free("big")
    pool.make_resident({"small"}, ads)  # the first free slot: big's
    slot = pool.get_slot("small")
    assert slot == big_slot
    assert pool.slot_ranks_device.tolist() == pool.slot_ranks and pool.slot_scalings_device.tolist() == pool.slot_scalings
    for layer in range(SHAPES.num_layers):
        for m in pool.fold_modules:
            shape = SHAPES.modules[m]
            c = len(shape.out_sizes)
            w_aug = pool.folded_weight[m][layer]
            assert torch.equal(w_aug[:, : shape.in_dim], bases[m, layer])  # loading never touches W
            # Rebuild the whole extra part from scratch: only small's diagonal blocks are non-zero.
            expected = torch.zeros_like(w_aug[:, shape.in_dim :])
            if m == "qkv_proj":
                _, b = small.layers[layer][m]
                lo = 0
                for k, size in enumerate(shape.out_sizes):
                    col = slot * c * 8 + k * 8
                    expected[lo : lo + size, col : col + 3] = b[lo : lo + size]
                    lo += size
            assert torch.equal(w_aug[:, shape.in_dim :], expected), (m, layer)
    assert pool.data_ptrs() == ptrs and pool.integrity_problems() == []


def test_a_fold_pool_keeps_a_in_w_aug_and_b_transposed():
    """The A-fold's layout (fold.a_fold_views): a folded o_proj / down_proj's A lives in the rows of
    W_aug's buffer past N (W_a = [W; A of the adapter slots] is one view, the base weight another),
    and the pool keeps B transposed beside it. Loading writes both; a smaller adapter moving in
    leaves no residue in the prefix the kernels read; nothing moves."""
    from test_mem_pool import SHAPES, make_adapter

    from sglang.srt.lora.mem_pool import LoRAMemoryPool

    modules = ["qkv_proj", "o_proj", "down_proj"]
    pool = LoRAMemoryPool(SHAPES, modules, 2, 8, torch.float32, "cpu", fold_candidates=modules, a_fold=True)
    assert pool.a_fold_modules == ["down_proj", "o_proj"]  # not qkv_proj: three output slices
    gen = torch.Generator().manual_seed(8)
    bases = {}
    for m in pool.fold_modules:
        for layer in range(SHAPES.num_layers):
            shape = SHAPES.modules[m]
            bases[m, layer] = torch.randn(shape.out_dim, shape.in_dim, generator=gen)
            pool.fold_base_weight(m, layer, bases[m, layer])
    ptrs = pool.data_ptrs()
    ads = {"big": make_adapter("big", r=8, modules=modules, seed=1), "small": make_adapter("small", r=3, seed=2,
                                                                                           modules=["o_proj"])}
    pool.make_resident({"big"}, ads)
    big_slot = pool.get_slot("big")
    for m in pool.a_fold_modules:
        shape = SHAPES.modules[m]
        for layer in range(SHAPES.num_layers):
            a, b = ads["big"].layers[layer][m]
            w_a, w_aug = pool.a_folded_weight[m][layer], pool.folded_weight[m][layer]
            assert w_a.shape == (shape.out_dim + 2 * 8, shape.in_dim) and w_a.data_ptr() == w_aug.data_ptr()
            assert torch.equal(w_a[: shape.out_dim], bases[m, layer])
            rows = shape.out_dim + big_slot * 8
            assert torch.equal(w_a[rows : rows + 8], a) and torch.equal(pool.A_buffer[m][layer][big_slot], a)
            assert torch.equal(pool.Bt_buffer[m][layer][big_slot], b.t())
            # One GEMM: the base output and the slot's shrink.
            x = torch.randn(3, shape.in_dim, generator=gen)
            out = x @ w_a.T
            torch.testing.assert_close(out[:, : shape.out_dim], x @ bases[m, layer].T)
            torch.testing.assert_close(out[:, rows : rows + 8], x @ a.T)
    pool.free("big")
    pool.make_resident({"small"}, ads)
    assert pool.get_slot("small") == big_slot
    for layer in range(SHAPES.num_layers):
        a, b = ads["small"].layers[layer]["o_proj"]
        assert torch.equal(pool.A_buffer["o_proj"][layer][big_slot][:3], a)
        assert torch.equal(pool.Bt_buffer["o_proj"][layer][big_slot][:3], b.t())
        assert not pool.A_buffer["o_proj"][layer][big_slot][3:].any()
        assert not pool.Bt_buffer["o_proj"][layer][big_slot][3:].any()
        assert not pool.A_buffer["down_proj"][layer][big_slot].any()  # small has no down_proj
        assert not pool.Bt_buffer["down_proj"][layer][big_slot].any()
    assert pool.data_ptrs() == ptrs and pool.integrity_problems() == []


def test_a_fold_rule_bounds_its_extra_bytes():
    """The A-fold reads S*R*(K - N) more bytes than the B fold: taken at 8 rank-16 adapter slots on
    the Qwen3-4B and Llama-8B shapes (what the H200 measured), not for a down_proj of 64 slots."""
    from sglang.srt.lora.fold import A_FOLD_MAX_EXTRA_BYTES, should_a_fold

    assert should_a_fold(9728, 2560, 8, 16, 2) and should_a_fold(14336, 4096, 8, 16, 2)  # down_proj
    assert should_a_fold(4096, 2560, 64, 16, 2)  # Qwen3-4B o_proj: K - N = 1,536
    assert not should_a_fold(9728, 2560, 64, 16, 2) and not should_a_fold(9728, 2560, 8, 64, 2)
    assert should_a_fold(4096, 4096, 256, 64, 2)  # K = N: nothing more to read
    assert 8 * 16 * (14336 - 4096) * 2 <= A_FOLD_MAX_EXTRA_BYTES


def test_manager_folds_and_logs(caplog):
    """The manager re-lays the base weights (the model's outputs do not change) and says what it did."""
    import logging

    from helpers import make_runner, tiny_checkpoint

    ckpt = tiny_checkpoint("llama", hidden_size=64, intermediate_size=128)
    args = dict(enable_lora=True, max_lora_rank=8, lora_target_modules=["all"], lora_backend="triton")
    plain = make_runner(ckpt)
    with caplog.at_level(logging.INFO, logger="sglang.srt.lora"):
        folded = make_runner(ckpt, **args)
    for module in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        assert f"{module}: folded into the base GEMM" in caplog.text
    layer = folded.model.model.layers[0].mlp.gate_up_proj
    assert layer.weight.data_ptr() == layer.lora.folded.data_ptr() and not layer.weight.is_contiguous()
    assert torch.equal(layer.weight, plain.model.model.layers[0].mlp.gate_up_proj.weight)
    off = make_runner(ckpt, lora_fold="off", **args)
    assert off.lora_manager.pool.fold_modules == [] and off.model.model.layers[0].mlp.gate_up_proj.lora.folded is None
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sglang.srt.lora"):
        native = make_runner(ckpt, **dict(args, lora_backend="torch_native", lora_fold="on"))
    assert native.lora_manager.pool.fold_modules == []  # the reference backend never folds
    assert "--lora-fold on: the torch_native LoRA backend does not fold" in caplog.text  # and says so


# ---- through the model ------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["triton", "csgmv"])
@pytest.mark.parametrize("fold", ["on", "off"])
def test_peft_parity_folded_and_not(backend, fold, tmp_path):
    """The tiny model folds by default; `off` runs the separate kernels: both match HF + PEFT."""
    from helpers import EngineDriver, hf_model, hf_prompt_logprobs, make_runner, tiny_checkpoint
    from lora_testlib import write_peft_adapter
    from peft import PeftModel

    ckpt = tiny_checkpoint("qwen3", hidden_size=64, intermediate_size=128)
    path = write_peft_adapter(str(tmp_path / "a"), r=8, base_model=hf_model(ckpt), seed=7)
    runner = make_runner(ckpt, lora_paths=[f"a={path}"], lora_backend=backend, lora_fold=fold, max_lora_rank=16)
    assert bool(runner.lora_manager.pool.fold_modules) == (fold == "on")
    lora_id = next(iter(runner.lora_manager.refs))
    prompts = [[5, 9, 13, 200, 7, 3, 99], [11, 4, 250]]
    driver = EngineDriver(runner)
    seqs = [driver.add(p, lora_id=i) for p, i in zip(prompts, [lora_id, None])]
    out = driver.extend(seqs, logprob_start=0)
    peft = PeftModel.from_pretrained(hf_model(ckpt), path).eval()
    refs = [hf_prompt_logprobs(peft, prompts[0]), hf_prompt_logprobs(hf_model(ckpt), prompts[1])]
    for got, ref in zip(out.input_token_logprobs, refs):
        torch.testing.assert_close(torch.tensor(got), ref, rtol=0, atol=1e-4)


@pytest.mark.parametrize("setting,apart", [("1", True), ("cols:0", True), ("cols:0,tokens:10", True),
                                           ("tokens:11", False)])
def test_csgmv_runs_folded_modules_apart_at_prefill(setting, apart, tmp_path, monkeypatch):
    """SGLANG_LORA_PREFILL_UNFOLD: csgmv's folded modules run apart at prefill (base GEMM over
    W_aug[:, :K], chunked shrink, the expand reading B inside W_aug, qkv's and gate_up's slices
    included) and keep the fold at decode; prompt logprobs match HF + PEFT, and the greedy tokens
    equal a server's without the setting. `tokens:T`: only prefills of at least T tokens (this
    one has 10; without prefill graphs a batch's bucket is its own token count)."""
    from helpers import EngineDriver, hf_model, hf_prompt_logprobs, make_runner, tiny_checkpoint
    from lora_testlib import write_peft_adapter
    from peft import PeftModel

    ckpt = tiny_checkpoint("qwen3", hidden_size=64, intermediate_size=128)
    path = write_peft_adapter(str(tmp_path / "a"), r=8, base_model=hf_model(ckpt), seed=7)
    args = dict(lora_paths=[f"a={path}"], lora_backend="csgmv", lora_fold="on", max_lora_rank=16)
    prompts = [[5, 9, 13, 200, 7, 3, 99], [11, 4, 250]]

    def run(unfold: str, fold: str = "on"):
        monkeypatch.setenv("SGLANG_LORA_PREFILL_UNFOLD", unfold)  # read when the backend is built
        runner = make_runner(ckpt, **{**args, "lora_fold": fold})
        backend, lora_id = runner.lora_manager.lora_backend, next(iter(runner.lora_manager.refs))
        specs = [s for s in backend.specs.values() if s.folded]
        assert {s.stack for s in specs} == ({1, 2, 3} if fold == "on" else set())
        driver = EngineDriver(runner)
        seqs = [driver.add(p, lora_id=i) for p, i in zip(prompts, [lora_id, None])]
        out = driver.extend(seqs, logprob_start=0)
        at_prefill = [backend._runs_folded(s) for s in specs]
        tokens = driver.continue_greedy(seqs, out, 3)
        at_decode = [backend._runs_folded(s) for s in specs]
        return out.input_token_logprobs, tokens, at_prefill, at_decode

    logprobs, tokens, at_prefill, at_decode = run(setting)
    assert all(at_decode) and (not any(at_prefill) if apart else all(at_prefill))
    peft = PeftModel.from_pretrained(hf_model(ckpt), path).eval()
    refs = [hf_prompt_logprobs(peft, prompts[0]), hf_prompt_logprobs(hf_model(ckpt), prompts[1])]
    for got, ref in zip(logprobs, refs):
        torch.testing.assert_close(torch.tensor(got), ref, rtol=0, atol=1e-4)
    _, folded_tokens, kept, _ = run("0")
    assert all(kept) and tokens == folded_tokens
    if apart:  # the same function as a server without the fold: base GEMM, chunked shrink and expand
        # Not bit for bit: the base GEMM reads W_aug[:, :K], a strided view, where the unfolded server
        # reads a contiguous W, and the CPU's BLAS may pick another kernel (another summation order)
        # for it; on an AVX-512 host the logprobs moved by 2e-6.
        unfolded = run("0", fold="off")[0]
        for got, ref in zip(logprobs, unfolded):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=0, atol=2e-5)


def test_prefill_unfold_setting_is_checked():
    from sglang.srt.lora.backend.chunked_backend import PrefillUnfold, parse_prefill_unfold

    assert parse_prefill_unfold("0") is None and parse_prefill_unfold("1") == PrefillUnfold(-1, 0)
    assert parse_prefill_unfold("cols:384") == PrefillUnfold(384, 0)
    assert parse_prefill_unfold("cols:0,tokens:1024") == PrefillUnfold(0, 1024)
    for bad in ("yes", "cols:", "cols:-1", "2", "tokens:8,tokens:9", "rows:4"):
        with pytest.raises(ValueError, match="SGLANG_LORA_PREFILL_UNFOLD"):
            parse_prefill_unfold(bad)


@pytest.mark.parametrize("setting,at_prefill,at_decode", [("1", True, True), ("tokens:9", False, True),
                                                          ("tokens:10", True, True)])
def test_csgmv_unfolded_modules_take_the_split_k_shrink(setting, at_prefill, at_decode, tmp_path, monkeypatch):
    """SGLANG_LORA_CSGMV_SPLIT_SHRINK: csgmv's unfolded modules take the token backend's split-K
    shrink (its launches prepared, the chunked expand kept) at the batches the rule admits (a
    10-token prefill, 2-row decode batches); prompt logprobs match HF + PEFT, and the greedy tokens
    equal a server's with the chunked shrink."""
    from helpers import EngineDriver, hf_model, hf_prompt_logprobs, make_runner, tiny_checkpoint
    from lora_testlib import write_peft_adapter
    from peft import PeftModel

    ckpt = tiny_checkpoint("qwen3", hidden_size=64, intermediate_size=128)
    path = write_peft_adapter(str(tmp_path / "a"), r=8, base_model=hf_model(ckpt), seed=7)
    args = dict(lora_paths=[f"a={path}"], lora_backend="csgmv", lora_fold="off", max_lora_rank=16,
                lora_fuse_norm="off")
    prompts = [[5, 9, 13, 200, 7, 3, 99], [11, 4, 250]]

    import sglang.srt.lora.backend.chunked_backend as chunked

    chunked_calls = []
    chunked_shrink = chunked.chunked_sgmv_lora_shrink_forward

    def counted(*a, **kw):
        chunked_calls.append(1)
        return chunked_shrink(*a, **kw)

    monkeypatch.setattr(chunked, "chunked_sgmv_lora_shrink_forward", counted)

    def step_took_split(backend) -> bool:
        """The batch's flag, and that no unfolded module ran the chunked shrink under it."""
        took = backend._split_shrink_now
        assert (len(chunked_calls) == 0) == took, (took, len(chunked_calls))
        chunked_calls.clear()
        return took

    def run(split: str):
        monkeypatch.setenv("SGLANG_LORA_CSGMV_SPLIT_SHRINK", split)  # read when the backend is built
        runner = make_runner(ckpt, **args)
        backend, lora_id = runner.lora_manager.lora_backend, next(iter(runner.lora_manager.refs))
        assert not any(s.folded for s in backend.specs.values())
        driver = EngineDriver(runner)
        seqs = [driver.add(p, lora_id=i) for p, i in zip(prompts, [lora_id, lora_id])]
        chunked_calls.clear()
        out = driver.extend(seqs, logprob_start=0)
        taken = [step_took_split(backend)]
        tokens = driver.continue_greedy(seqs, out, 3, lambda: taken.append(step_took_split(backend)))
        return out.input_token_logprobs, tokens, taken

    logprobs, tokens, taken = run(setting)
    assert taken == [at_prefill] + [at_decode] * 3
    peft = PeftModel.from_pretrained(hf_model(ckpt), path).eval()
    for got, prompt in zip(logprobs, prompts):
        torch.testing.assert_close(torch.tensor(got), hf_prompt_logprobs(peft, prompt), rtol=0, atol=1e-4)
    _, chunked_tokens, never = run("0")
    assert not any(never) and tokens == chunked_tokens


def test_split_shrink_setting_is_checked():
    from sglang.srt.lora.backend.chunked_backend import split_shrink_bound

    assert split_shrink_bound("0") is None and split_shrink_bound("1") >= 1 << 20
    assert split_shrink_bound("tokens:512") == 512
    for bad in ("yes", "tokens:", "tokens:0", "rows:4", "2", "tokens:-3"):
        with pytest.raises(ValueError, match="SGLANG_LORA_CSGMV_SPLIT_SHRINK"):
            split_shrink_bound(bad)
