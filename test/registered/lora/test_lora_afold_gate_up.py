"""SGLANG_LORA_AFOLD_GATE_UP=1 (csgmv) through the model (CPU, TRITON_INTERPRET=1, float32): at the
decode batches whose o_proj / down_proj leave their delta to the norm after them, gate_up_proj runs
as an A-fold too. The norm before it adds o_proj's delta and writes plain rows (norm_delta, no
shrink), one GEMM over [W; A of every slot] gives the base output and every slot's shrink, and the
SiLU-and-mul adds the row's delta (its slot's block of that shrink, B read inside W_aug) before the
activation. The decode equals the unfused engine's to float32 rounding; where the activation takes
no fusion, the module runs its own expand and still equals it. Prefill and larger decode batches
keep the B fold."""

from __future__ import annotations

import pytest
import torch

from lora_testlib import two_adapter_assets
from test_lora_norm_fusion import decode_run, runner_for


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return two_adapter_assets(tmp_path_factory.mktemp("afold-gate-up"))


def gate_up_runner(assets, monkeypatch, afold: str = "small", setting: str = "1"):
    monkeypatch.setenv("SGLANG_LORA_AFOLD_GATE_UP", setting)
    runner = runner_for(assets, "csgmv", fuse=True, afold=afold)
    monkeypatch.delenv("SGLANG_LORA_AFOLD_GATE_UP")
    return runner


def watch(monkeypatch):
    """Count the A-folded gate_up's kernels: the plain norms and the expands in the activation that
    read every slot's shrink (x_slot_stride > 0); and the module's own expand (the fallback)."""
    from sglang.srt.lora.backend import chunked_backend

    seen = {"norm_delta": 0, "expand_silu": 0, "own_expand": 0}
    norm_delta, expand_silu = chunked_backend.norm_delta, chunked_backend.segmented_expand_silu

    def counting_norm(*a, **kw):
        seen["norm_delta"] += 1
        return norm_delta(*a, **kw)

    def counting_expand(*a, x_slot_stride=0, **kw):
        seen["expand_silu"] += x_slot_stride > 0
        return expand_silu(*a, x_slot_stride=x_slot_stride, **kw)

    monkeypatch.setattr(chunked_backend, "norm_delta", counting_norm)
    monkeypatch.setattr(chunked_backend, "segmented_expand_silu", counting_expand)
    run_a_folded = chunked_backend.ChunkedSgmvLoRABackend.run_a_folded

    def counting_own(self, weights, x):
        seen["own_expand"] += weights.spec.name == "gate_up_proj"
        return run_a_folded(self, weights, x)

    monkeypatch.setattr(chunked_backend.ChunkedSgmvLoRABackend, "run_a_folded", counting_own)
    return seen


def test_gate_up_a_fold_at_small_decode_equals_the_unfused_engine(assets, monkeypatch):
    runner = gate_up_runner(assets, monkeypatch)
    pool = runner.lora_manager.pool
    assert "gate_up_proj" in pool.a_fold_modules and "gate_up_proj" not in pool.Bt_buffer
    layers = runner.model.model.layers
    assert all(l.mlp.gate_up_proj.defers_to_act for l in layers)
    seen = watch(monkeypatch)
    tokens, logprobs, calls = decode_run(runner)
    monkeypatch.undo()
    steps = 4
    assert seen == {"norm_delta": steps * len(layers), "expand_silu": steps * len(layers), "own_expand": 0}
    assert calls == [0] + [2 * len(layers)] * steps  # both norms still fuse (one of them with no shrink)
    ref_tokens, ref_logprobs, _ = decode_run(runner_for(assets, "csgmv", fuse=False))
    assert tokens == ref_tokens
    torch.testing.assert_close(logprobs, ref_logprobs, rtol=0, atol=1e-5)
    # Adapter b has only q / v / up: its rows move with up_proj's delta, which only the activation adds.
    _, base_logprobs, _ = decode_run(runner, names=(None,) * 4)
    assert float((logprobs - base_logprobs)[:, 2].abs().max()) > 1e-3
    assert float((logprobs - base_logprobs)[:, 1].abs().max()) < 1e-5


def test_without_the_activations_fusion_gate_up_runs_its_own_expand(assets, monkeypatch):
    runner = gate_up_runner(assets, monkeypatch)
    for layer in runner.model.model.layers:  # as for a model whose activation the fusion cannot take
        layer.mlp.act_fn.fusion = None
        layer.mlp.gate_up_proj.defers_to_act = False
    seen = watch(monkeypatch)
    tokens, logprobs, _ = decode_run(runner, steps=2)
    monkeypatch.undo()
    layers = len(runner.model.model.layers)
    assert seen == {"norm_delta": 2 * layers, "expand_silu": 0, "own_expand": 2 * layers}
    ref_tokens, ref_logprobs, _ = decode_run(runner_for(assets, "csgmv", fuse=False), steps=2)
    assert tokens == ref_tokens
    torch.testing.assert_close(logprobs, ref_logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("afold,setting", [("0", "1"), ("small", "0")])
def test_off_without_the_deferring_norms_or_when_asked(assets, afold, setting, monkeypatch):
    """Without SGLANG_LORA_AFOLD (no deferring decode batches) the pool keeps gate_up_proj's plain
    fold, as with the knob off; a value other than 0 / 1 is refused."""
    runner = gate_up_runner(assets, monkeypatch, afold=afold, setting=setting)
    assert "gate_up_proj" not in runner.lora_manager.pool.a_fold_modules
    seen = watch(monkeypatch)
    decode_run(runner, steps=1)
    monkeypatch.undo()
    assert seen == {"norm_delta": 0, "expand_silu": 0, "own_expand": 0}
    monkeypatch.setenv("SGLANG_LORA_AFOLD_GATE_UP", "small")
    with pytest.raises(ValueError, match="SGLANG_LORA_AFOLD_GATE_UP"):
        runner_for(assets, "csgmv", fuse=True)
