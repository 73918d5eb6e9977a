"""`--lora-fuse-norm` through the model (CPU, TRITON_INTERPRET=1, float32): at decode the norms
before qkv_proj and gate_up_proj compute their shrink (auto, the default, and on: folded modules
and unfolded ones), and a mixed batch
(two adapters and the base model) decodes what the unfused engine decodes, with the same logprobs
to float32 rounding. Prefill never fuses; a backend without the kernels warns and runs apart; the
model's parameters and modules stay the same."""

from __future__ import annotations

import logging
import os
from typing import Optional

import pytest
import torch

from helpers import EngineDriver, hf_model, make_runner
from lora_testlib import two_adapter_assets, write_peft_adapter
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.lora.norm_fusion import NormShrinkFusion

PROMPTS = [[5, 9, 13, 200, 7, 3, 99], [11, 4, 250], [17, 18, 19, 20, 21], [300, 2, 8, 8]]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return two_adapter_assets(tmp_path_factory.mktemp("norm-fusion"))


def runner_for(assets, backend: str, fuse, rowwise: bool = False, fold: str = "auto", afold: str = "0",
               afold_expand: bool = False, afold_qkv: Optional[str] = "0"):
    """fuse: a --lora-fuse-norm mode, or True / False for on / off. afold_qkv: csgmv's
    SGLANG_LORA_AFOLD_QKV, off here unless asked (the default, None, takes it at these short
    prefills, and these tests count what the norm before qkv_proj does)."""
    # o_proj / down_proj take the row-wise kernel at every decode batch (1) or never (0; the
    # default, small, would at these tests' small batches), and defer their delta to the next norm
    # (afold: SGLANG_LORA_AFOLD, off here unless asked: the default, small, would at these batches).
    # Read when the backend is built.
    os.environ["SGLANG_LORA_ROWWISE_DECODE"] = "1" if rowwise else "0"
    os.environ["SGLANG_LORA_AFOLD"] = afold
    os.environ["SGLANG_LORA_AFOLD_EXPAND"] = "1" if afold_expand else "0"
    if afold_qkv is not None:
        os.environ["SGLANG_LORA_AFOLD_QKV"] = afold_qkv
    ckpt, paths = assets
    try:
        runner = make_runner(ckpt, lora_paths=[f"{n}={p}" for n, p in paths.items()], lora_backend=backend,
                             max_lora_rank=8, lora_fuse_norm=fuse, lora_fold=fold)
    finally:
        del os.environ["SGLANG_LORA_ROWWISE_DECODE"], os.environ["SGLANG_LORA_AFOLD"]
        del os.environ["SGLANG_LORA_AFOLD_EXPAND"]
        os.environ.pop("SGLANG_LORA_AFOLD_QKV", None)
    assert runner.lora_manager.lora_backend.__dict__.get("rowwise_decode", False) == rowwise
    return runner


def decode_run(runner, steps: int = 4, names=("a", None, "b", "a")):
    """Prefill the prompts (adapters a, base, b, a by default), then `steps` greedy decode passes; the
    tokens and decode logprobs, and how many fused norm calls each pass made."""
    ids = {r.lora_name: i for i, r in runner.lora_manager.refs.items()}
    backend = runner.lora_manager.lora_backend
    calls = []
    original = backend.run_norm

    def counting(*args, **kwargs):
        calls[-1] += 1
        return original(*args, **kwargs)

    backend.run_norm = counting
    driver = EngineDriver(runner)
    seqs = [driver.add(p, lora_id=ids.get(n)) for p, n in zip(PROMPTS, names)]
    calls.append(0)
    out = driver.extend(seqs)
    tokens, logprobs = [], []
    for _ in range(steps):
        for seq, t in zip(seqs, out.next_token_ids.tolist()):
            seq.tokens.append(t)
        calls.append(0)
        out = driver.decode(seqs, return_logprob=True)
        tokens.append(out.next_token_ids.tolist())
        logprobs.append(out.next_token_logprobs)
    del backend.run_norm
    return tokens, torch.tensor(logprobs, dtype=torch.float64), calls


@pytest.fixture(scope="module")
def unfused(assets):
    """unfused(backend, fold="auto", steps=4): decode_run of the unfused engine (--lora-fuse-norm off,
    every other setting runner_for's default, nothing in the environment), the reference most tests
    compare with. Computed once per (backend, fold, steps) in the module: many tests and parameters
    compare with the same one, and building and running it again gave the same numbers."""
    done: dict = {}

    def reference(backend: str, fold: str = "auto", steps: int = 4):
        key = (backend, fold, steps)
        if key not in done:
            done[key] = decode_run(runner_for(assets, backend, fuse=False, fold=fold), steps=steps)
        return done[key]

    return reference


@pytest.mark.parametrize("backend,fold,rowwise", [("triton", "auto", False), ("csgmv", "auto", False),
                                                  ("csgmv", "auto", True), ("triton", "off", False),
                                                  ("csgmv", "off", False), ("triton", "off", True)])
def test_fused_decode_equals_unfused(assets, unfused, backend, fold, rowwise, monkeypatch):
    """Folded (auto, at these sizes) and unfolded (off) modules; with SGLANG_LORA_ROWWISE_DECODE the
    folded o_proj / down_proj take the row-wise kernel too."""
    fused_runner = runner_for(assets, backend, fuse=True, rowwise=rowwise, fold=fold)
    assert bool(fused_runner.lora_manager.pool.fold_modules) == (fold == "auto")
    layers = fused_runner.model.model.layers
    assert all(isinstance(l.input_layernorm.fusion, NormShrinkFusion) for l in layers)
    assert all(isinstance(l.post_attention_layernorm.fusion, NormShrinkFusion) for l in layers)
    from sglang.srt.lora.backend import token_backend

    kernel_calls = []
    for name in ("norm_shrink_pack", "norm_shrink", "silu_shrink_pack", "silu_shrink"):  # folded / unfolded
        kernel = getattr(token_backend, name)
        monkeypatch.setattr(token_backend, name,
                            lambda *a, _k=kernel, _n=name, **kw: kernel_calls.append(_n) or _k(*a, **kw))
    tokens, logprobs, calls = decode_run(fused_runner)
    monkeypatch.undo()
    # One row-wise kernel per norm-fed module, of its layout; when asked, also for o_proj (in place of
    # shrink_pack) and down_proj (with the SiLU-and-mul before it).
    folded = fold == "auto"
    steps = 4 * len(layers)
    norm_calls = kernel_calls.count("norm_shrink_pack" if folded else "norm_shrink")
    silu_calls = kernel_calls.count("silu_shrink_pack" if folded else "silu_shrink")
    assert norm_calls == (3 if rowwise and folded else 2) * steps  # an unfolded o_proj keeps its kernels
    assert silu_calls == (steps if rowwise else 0)
    assert len(kernel_calls) == norm_calls + silu_calls
    ref_tokens, ref_logprobs, ref_calls = unfused(backend, fold)
    assert calls == [0] + [2 * len(layers)] * 4  # never at prefill, both norms of every layer at decode
    assert ref_calls == [0] * 5
    assert tokens == ref_tokens
    torch.testing.assert_close(logprobs, ref_logprobs, rtol=0, atol=1e-5)
    # The adapters moved the fused run's outputs (their deltas were not dropped).
    _, base_logprobs, _ = decode_run(fused_runner, names=(None,) * 4)
    assert float((logprobs - base_logprobs)[:, [0, 2, 3]].abs().max()) > 1e-3
    assert float((logprobs - base_logprobs)[:, 1].abs().max()) < 1e-5


@pytest.mark.parametrize("backend,rowwise", [("triton", False), ("csgmv", False), ("csgmv", True)])
def test_a_folded_o_and_down_leave_their_delta_to_the_next_norm(assets, unfused, backend, rowwise, monkeypatch):
    """SGLANG_LORA_AFOLD (the default, `small`, at these batches): the folded o_proj and down_proj
    run one GEMM over [W; A] and the norm after each adds the row's delta (post_attention_layernorm
    o_proj's, the next layer's input_layernorm down_proj's; the last down_proj, before the final norm,
    keeps its kernel): no LoRA kernel of their own at decode, also where the row-wise kernels would
    run, and the decode equals the unfused engine's to float32 rounding."""
    runner = runner_for(assets, backend, fuse=True, rowwise=rowwise, afold="small")
    pool = runner.lora_manager.pool
    assert pool.a_fold_modules == ["down_proj", "o_proj"]
    layers = runner.model.model.layers
    assert [l.self_attn.o_proj.defers_to_norm for l in layers] == [True] * len(layers)
    assert [l.mlp.down_proj.defers_to_norm for l in layers] == [True] * (len(layers) - 1) + [False]
    assert layers[0].input_layernorm.fusion.producer is None
    assert layers[1].input_layernorm.fusion.producer is layers[0].mlp.down_proj
    assert layers[0].post_attention_layernorm.fusion.producer is layers[0].self_attn.o_proj
    from sglang.srt.lora.backend import token_backend

    backend_obj = runner.lora_manager.lora_backend
    module_calls, deltas = [], []
    run_module, run_norm = backend_obj.run_module, backend_obj.run_norm
    monkeypatch.setattr(backend_obj, "run_module",
                        lambda w, *a, **kw: module_calls.append(w.spec.name) or run_module(w, *a, **kw))
    def counting_norm(*a, delta=None, **kw):
        deltas.append(delta is not None)
        return run_norm(*a, delta=delta, **kw)

    monkeypatch.setattr(backend_obj, "run_norm", counting_norm)
    silu = token_backend.silu_shrink_pack
    silu_calls = []
    monkeypatch.setattr(token_backend, "silu_shrink_pack", lambda *a, **kw: silu_calls.append(1) or silu(*a, **kw))
    tokens, logprobs, _ = decode_run(runner)
    monkeypatch.undo()
    prefill_calls = 4 * len(layers)  # every module at prefill (nothing fuses or defers there)
    assert module_calls[:prefill_calls].count("o_proj") == len(layers)
    # At decode, only the last layer's down_proj still calls its own kernel (row-wise: the SiLU's).
    assert module_calls[prefill_calls:] == ([] if rowwise else ["down_proj"] * 4)
    assert len(silu_calls) == (4 if rowwise else 0)
    # Every norm but the first layer's input_layernorm takes a delta.
    assert deltas == ([False] + [True] * (2 * len(layers) - 1)) * 4
    ref_tokens, ref_logprobs, _ = unfused(backend)
    assert tokens == ref_tokens
    torch.testing.assert_close(logprobs, ref_logprobs, rtol=0, atol=1e-5)
    _, base_logprobs, _ = decode_run(runner, names=(None,) * 4)
    assert float((logprobs - base_logprobs)[:, [0, 3]].abs().max()) > 1e-3  # adapter a has o_proj / down_proj


def test_a_folded_o_and_down_past_the_bound_run_the_expand(assets, unfused, monkeypatch):
    """SGLANG_LORA_AFOLD_EXPAND=1 (csgmv): past the deferral's bound (rows:2 here, the batch has 4)
    the A-folded modules run their GEMM over [W; A] and the segmented expand of every slot's shrink
    (not shrink_pack and the GEMM over W_aug); the last down_proj, with no fused norm after it, keeps
    the fold. The decode equals the unfused engine's to float32 rounding. (The prefill keeps
    shrink_pack here, SGLANG_LORA_AFOLD_PREFILL=0, so that only decode steps count.)"""
    monkeypatch.setenv("SGLANG_LORA_AFOLD_PREFILL", "0")
    runner = runner_for(assets, "csgmv", fuse=True, afold="rows:2", afold_expand=True)
    backend_obj = runner.lora_manager.lora_backend
    from sglang.srt.lora.backend import chunked_backend

    expands, deltas = [], []
    expand = chunked_backend.chunked_sgmv_lora_expand_forward
    monkeypatch.setattr(chunked_backend, "chunked_sgmv_lora_expand_forward",
                        lambda *a, **kw: expands.append(kw.get("x_slot_stride", 0)) or expand(*a, **kw))
    run_norm = backend_obj.run_norm
    def counting_norm(*a, delta=None, **kw):
        deltas.append(delta is not None)
        return run_norm(*a, delta=delta, **kw)

    monkeypatch.setattr(backend_obj, "run_norm", counting_norm)
    tokens, logprobs, _ = decode_run(runner)
    monkeypatch.undo()
    layers = len(runner.model.model.layers)
    assert expands == [8] * ((2 * layers - 1) * 4)  # x_slot_stride = the pool rank, every decode step
    assert not any(deltas)
    ref_tokens, ref_logprobs, _ = unfused("csgmv")
    assert tokens == ref_tokens
    torch.testing.assert_close(logprobs, ref_logprobs, rtol=0, atol=1e-5)


def test_a_fold_is_off_without_norm_fusion(assets):
    """The deltas go to fused norms: with --lora-fuse-norm off the pool lays out no A-fold."""
    runner = runner_for(assets, "csgmv", fuse=False, afold="small")
    assert runner.lora_manager.pool.a_fold_modules == []
    assert not any(m.defers_to_norm for layer in runner.lora_manager.lora_modules.values() for m in layer.values())


@pytest.mark.parametrize("fold", ["auto", "off"])
def test_the_default_fuses_the_norms_before_folded_and_unfolded_modules(assets, fold, caplog):
    """--lora-fuse-norm auto (the default): the norms before folded modules (auto, at these sizes)
    and unfolded ones (off) compute their shrink, and the decode equals the unfused engine's to
    float32 rounding; a backend without the kernels says nothing."""
    with caplog.at_level(logging.WARNING, logger="sglang.srt.lora"):
        runner = runner_for(assets, "csgmv", fuse="auto", fold=fold)
    assert "--lora-fuse-norm" not in caplog.text
    assert bool(runner.lora_manager.pool.fold_modules) == (fold == "auto")
    layers = runner.model.model.layers
    assert all(isinstance(n.fusion, NormShrinkFusion) for l in layers for n in (l.input_layernorm,
                                                                               l.post_attention_layernorm))
    assert runner.lora_manager.lora_backend.fuse_norm
    tokens, logprobs, calls = decode_run(runner)
    assert calls == [0] + [2 * len(layers)] * 4
    ref_tokens, ref_logprobs, _ = decode_run(runner_for(assets, "csgmv", fuse="off", fold=fold))
    assert tokens == ref_tokens
    torch.testing.assert_close(logprobs, ref_logprobs, rtol=0, atol=1e-5)
    with caplog.at_level(logging.WARNING, logger="sglang.srt.lora"):
        runner_for(assets, "torch_native", fuse="auto")
    assert "no fused norm kernels" not in caplog.text


def test_fusion_keeps_the_model_tree(assets):
    plain = runner_for(assets, "triton", fuse=False)
    fused = runner_for(assets, "triton", fuse=True)
    assert [n for n, _ in fused.model.named_parameters()] == [n for n, _ in plain.model.named_parameters()]
    assert [n for n, _ in fused.model.named_modules()] == [n for n, _ in plain.model.named_modules()]


def test_a_backend_without_the_kernels_warns_and_runs_apart(assets, caplog):
    with caplog.at_level(logging.WARNING, logger="sglang.srt.lora"):
        runner = runner_for(assets, "torch_native", fuse=True)
    assert "no fused norm kernels" in caplog.text
    norms = [m for m in runner.model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(m.fusion is None for m in norms)
    _, _, calls = decode_run(runner, steps=1)
    assert calls == [0, 0]


def test_no_lora_on_the_norm_fed_modules_nothing_fused(assets, caplog, tmp_path, monkeypatch):
    """An adapter on o_proj / down_proj only: no norm fuses. By default (row-wise o_proj / down_proj
    at small decode batches) the SiLU-and-mul before each down_proj carries down_proj's shrink;
    with SGLANG_LORA_ROWWISE_DECODE=0 and SGLANG_LORA_PACK_IN_PLACE=0 (by default the SiLU-and-mul
    writes a folded down_proj's x_aug at prefill) nothing fuses, and the log says why."""
    from sglang.srt.layers.activation import SiluAndMul

    ckpt, _ = assets
    path = write_peft_adapter(str(tmp_path / "od"), r=4, target_modules=["o_proj", "down_proj"],
                              base_model=hf_model(ckpt), seed=9)

    def build():
        return make_runner(ckpt, lora_paths=[f"od={path}"], lora_backend="triton", lora_fuse_norm=True)

    monkeypatch.delenv("SGLANG_LORA_ROWWISE_DECODE", raising=False)
    runner = build()
    assert all(m.fusion is None for m in runner.model.modules() if isinstance(m, RMSNorm))
    acts = [m for m in runner.model.modules() if isinstance(m, SiluAndMul)]
    assert acts and all(m.fusion is not None for m in acts)
    monkeypatch.setenv("SGLANG_LORA_ROWWISE_DECODE", "0")
    monkeypatch.setenv("SGLANG_LORA_PACK_IN_PLACE", "0")
    with caplog.at_level(logging.WARNING, logger="sglang.srt.lora"):
        runner = build()
    assert "no norm feeds a LoRA" in caplog.text
    assert all(m.fusion is None for m in runner.model.modules() if isinstance(m, (RMSNorm, SiluAndMul)))


@pytest.mark.parametrize("backend,afold", [("triton", "0"), ("csgmv", "0"), ("csgmv", "small")])
def test_prefill_producers_write_into_x_aug(assets, backend, afold, monkeypatch):
    """SGLANG_LORA_PACK_IN_PLACE=1: at prefill, where no kernel fuses, the norms before the folded
    qkv_proj / gate_up_proj and the SiLU-and-mul before the folded down_proj write their output
    into the module's x_aug, and shrink_pack adds only the shrink. The same kernels compute the
    same values, so the whole run equals the copying one bit for bit (decode, which fuses, reads
    the prefill's KV cache)."""
    from sglang.srt.layers.triton_ops.dispatch import fused_kernels

    monkeypatch.setenv("SGLANG_LORA_PACK_IN_PLACE", "1")
    in_place = runner_for(assets, backend, fuse=True, afold=afold)
    monkeypatch.setenv("SGLANG_LORA_PACK_IN_PLACE", "0")
    copying = runner_for(assets, backend, fuse=True, afold=afold)
    backend_obj = in_place.lora_manager.lora_backend
    assert backend_obj.pack_in_place and not copying.lora_manager.lora_backend.pack_in_place
    layers = in_place.model.model.layers
    assert all(l.mlp.act_fn.fusion is not None for l in layers)  # attached for down_proj too
    answered = []
    in_place_input = backend_obj.in_place_input
    monkeypatch.setattr(backend_obj, "in_place_input",
                        lambda *a, **kw: answered.append(in_place_input(*a, **kw)) or answered[-1])
    with fused_kernels("triton"):
        tokens, logprobs, _ = decode_run(in_place)
        ref_tokens, ref_logprobs, _ = decode_run(copying)
    monkeypatch.undo()
    # qkv_proj, gate_up_proj and down_proj of every layer, once, at the prefill; never at decode.
    assert sum(p is not None for p in answered) == 3 * len(layers)
    assert tokens == ref_tokens
    assert torch.equal(logprobs, ref_logprobs)


def watch_expands_and_in_place(backend_obj, monkeypatch) -> tuple[list[int], list]:
    """Record each csgmv expand's x_slot_stride (0: the compact shrink; R or 3R: every slot's, the
    A-fold's) and each in_place_input answer as (module name, prepared or None)."""
    from sglang.srt.lora.backend import chunked_backend

    expands, answered = [], []
    expand = chunked_backend.chunked_sgmv_lora_expand_forward
    monkeypatch.setattr(chunked_backend, "chunked_sgmv_lora_expand_forward",
                        lambda *a, **kw: expands.append(kw.get("x_slot_stride", 0)) or expand(*a, **kw))
    in_place_input = backend_obj.in_place_input
    monkeypatch.setattr(backend_obj, "in_place_input",
                        lambda *a, **kw: answered.append((a[0].spec.name, in_place_input(*a, **kw))) or answered[-1][1])
    return expands, answered


@pytest.mark.parametrize("bound,in_place", [("1", False), ("1", True), ("rows:4", True)])
def test_a_folded_o_and_down_run_the_expand_at_prefill(assets, unfused, bound, in_place, monkeypatch):
    """SGLANG_LORA_AFOLD_PREFILL=1 (csgmv): prefills run the A-folded o_proj / down_proj as their
    GEMM over [W; A] and the segmented expand too (the last down_proj keeps the fold); rows:4 only
    prefills of at most 4 tokens (this one has 19: shrink_pack as before). The plain norm after
    each reads the strided output; with SGLANG_LORA_PACK_IN_PLACE it writes the next module's
    x_aug, and the SiLU-and-mul before an A-folded down_proj writes a plain output. The run equals
    the unfused engine's to float32 rounding."""
    from sglang.srt.layers.triton_ops.dispatch import fused_kernels

    monkeypatch.setenv("SGLANG_LORA_AFOLD_PREFILL", bound)
    monkeypatch.setenv("SGLANG_LORA_PACK_IN_PLACE", "1" if in_place else "0")
    runner = runner_for(assets, "csgmv", fuse=True, afold="small", afold_expand=True)
    monkeypatch.delenv("SGLANG_LORA_AFOLD_PREFILL")
    monkeypatch.delenv("SGLANG_LORA_PACK_IN_PLACE")
    backend_obj = runner.lora_manager.lora_backend
    assert backend_obj.afold_prefill_max == (1 << 30 if bound == "1" else 4)
    assert backend_obj.pack_in_place == in_place
    expanding = bound == "1"
    expands, answered = watch_expands_and_in_place(backend_obj, monkeypatch)
    with fused_kernels("triton"):
        tokens, logprobs, _ = decode_run(runner, steps=2)
    monkeypatch.undo()
    layers = len(runner.model.model.layers)
    # The prefill: every o_proj and every down_proj but the last; decode defers to the norms (small).
    assert expands == [8] * ((2 * layers - 1) if expanding else 0)
    # In place: qkv_proj and gate_up_proj of every layer and the down_proj that do not expand.
    assert sum(p is not None for _, p in answered) == (((2 * layers + 1) if expanding else 3 * layers) if in_place else 0)
    ref_tokens, ref_logprobs, _ = unfused("csgmv", steps=2)
    assert tokens == ref_tokens
    torch.testing.assert_close(logprobs, ref_logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("afold,kernels", [("0", "triton"), ("small", "triton"), ("0", "torch")])
def test_a_folded_qkv_runs_the_expand_at_prefill(assets, unfused, afold, kernels, monkeypatch):
    """SGLANG_LORA_AFOLD_QKV=1 (csgmv): qkv_proj's W_aug buffer also holds A (three slices per slot),
    and prefills run its GEMM over [W; A] and the segmented expand of every slot's shrink (x_slot_stride
    3 * R, B inside W_aug) into a strided output, which RoPE reads in place; the norm before it
    writes plain rows (in_place_input declines it). Decode keeps the fused norm. With o_proj /
    down_proj A-folded too (small) or not; the layers' Triton kernels (RoPE's in place) or torch's.
    The run equals the unfused engine's to float32 rounding."""
    from sglang.srt.layers.triton_ops.dispatch import fused_kernels

    runner = runner_for(assets, "csgmv", fuse=True, afold=afold, afold_expand=afold != "0", afold_qkv="1")
    pool, backend_obj = runner.lora_manager.pool, runner.lora_manager.lora_backend
    assert "qkv_proj" in pool.a_fold_modules and "qkv_proj" not in pool.Bt_buffer
    assert ("o_proj" in pool.a_fold_modules) == (afold != "0")
    expands, answered = watch_expands_and_in_place(backend_obj, monkeypatch)
    with fused_kernels(kernels):
        tokens, logprobs, calls = decode_run(runner, steps=2)
    monkeypatch.undo()
    layers = len(runner.model.model.layers)
    rank = pool.max_lora_rank
    # The prefill: qkv_proj of every layer (3 slices a slot); o_proj / down_proj with the A-fold too.
    qkv_expands = [s for s in expands if s == 3 * rank]
    assert len(qkv_expands) == layers
    assert len(expands) == layers + ((2 * layers - 1) if afold != "0" else 0)
    assert not any(p is not None for name, p in answered if name == "qkv_proj")
    assert any(p is not None for name, p in answered if name == "gate_up_proj") == (kernels == "triton")
    assert calls[0] == 0 and all(c == 2 * layers for c in calls[1:])  # decode fuses both norms
    ref_tokens, ref_logprobs, _ = unfused("csgmv", steps=2)
    assert tokens == ref_tokens
    torch.testing.assert_close(logprobs, ref_logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("setting,takes", [(None, True), ("tokens:64", True), ("tokens:16", False), ("0", False)])
def test_the_qkv_a_fold_takes_prefills_within_its_bound(assets, unfused, setting, takes, monkeypatch):
    """SGLANG_LORA_AFOLD_QKV's bound: the default (tokens:1024) and tokens:64 take this 19-token
    prefill, tokens:16 leaves it to the fold (the pool keeps the A-fold's layout), 0 lays out the
    plain fold. Either way the run equals the unfused engine's to float32 rounding."""
    from sglang.srt.layers.triton_ops.dispatch import fused_kernels
    from sglang.srt.lora.backend.chunked_backend import AFOLD_QKV_DEFAULT, afold_qkv_bound

    assert afold_qkv_bound(AFOLD_QKV_DEFAULT) == 1024 and afold_qkv_bound("0") is None
    assert afold_qkv_bound("1") >= 1 << 20
    for bad in ("2", "tokens:", "tokens:0", "rows:4"):
        with pytest.raises(ValueError, match="SGLANG_LORA_AFOLD_QKV"):
            afold_qkv_bound(bad)
    runner = runner_for(assets, "csgmv", fuse=True, afold_qkv=setting)
    pool = runner.lora_manager.pool
    assert ("qkv_proj" in pool.a_fold_modules) == (setting != "0")
    expands, answered = watch_expands_and_in_place(runner.lora_manager.lora_backend, monkeypatch)
    with fused_kernels("triton"):  # the norm's in-place write into x_aug is the Triton kernel's
        tokens, logprobs, _ = decode_run(runner, steps=2)
    monkeypatch.undo()
    assert len([s for s in expands if s == 3 * pool.max_lora_rank]) == (len(runner.model.model.layers) if takes else 0)
    assert any(p is not None for name, p in answered if name == "qkv_proj") == (not takes)
    ref_tokens, ref_logprobs, _ = unfused("csgmv", steps=2)
    assert tokens == ref_tokens
    torch.testing.assert_close(logprobs, ref_logprobs, rtol=0, atol=1e-5)


def test_a_qkv_proj_with_a_bias_keeps_the_fold(tmp_path, monkeypatch):
    """Qwen2's qkv_proj has a bias, which the GEMM over [W; A] has no place for: with
    SGLANG_LORA_AFOLD_QKV=1 the pool lays out the A-fold, but the layer gets no A-folded weight and
    its prefill runs the B fold; prompt logprobs match HF + PEFT."""
    from helpers import hf_prompt_logprobs, tiny_checkpoint
    from peft import PeftModel

    ckpt = tiny_checkpoint("qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    path = write_peft_adapter(str(tmp_path / "a"), r=8, base_model=hf_model(ckpt), seed=7)
    monkeypatch.setenv("SGLANG_LORA_AFOLD_QKV", "1")
    runner = make_runner(ckpt, lora_paths=[f"a={path}"], lora_backend="csgmv", max_lora_rank=8)
    monkeypatch.delenv("SGLANG_LORA_AFOLD_QKV")
    assert "qkv_proj" in runner.lora_manager.pool.a_fold_modules
    qkv = [m["qkv_proj"] for m in runner.lora_manager.lora_modules.values()]
    assert qkv and all(m.bias is not None and m.lora.a_folded is None for m in qkv)
    driver = EngineDriver(runner)
    seqs = [driver.add(p, lora_id=next(iter(runner.lora_manager.refs))) for p in PROMPTS[:2]]
    out = driver.extend(seqs, logprob_start=0)
    peft = PeftModel.from_pretrained(hf_model(ckpt), path).eval()
    for got, prompt in zip(out.input_token_logprobs, PROMPTS[:2]):
        torch.testing.assert_close(torch.tensor(got), hf_prompt_logprobs(peft, prompt), rtol=0, atol=1e-4)


