"""The linear layers' one-row GEMV (layers/triton_ops/gemv.py, SGLANG_ONE_ROW_GEMV). CPU,
TRITON_INTERPRET=1, float32.

The kernel equals F.linear (with and without a bias, K not a multiple of its tile); `linear`
takes it only for one row, with the switch on, where the Triton kernels run; a tiny model decoding
one request with it equals the model with cuBLAS's path (here torch's) to float32 rounding, and the
prefill never calls it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import sglang.srt.layers.triton_ops.gemv as gemv_mod
from helpers import EngineDriver, count_calls, greedy_decode_one, make_runner, tiny_checkpoint
from sglang.srt.layers.triton_ops.dispatch import fused_kernels
from sglang.srt.layers.triton_ops.gemv import gemv, gemv_config, linear


@pytest.mark.parametrize("n,k,bias", [(40, 300, False), (96, 64, True), (24, 4100, True), (5, 9000, False)])
def test_gemv_equals_f_linear(n, k, bias):
    gen = torch.Generator().manual_seed(n + k)
    x, w = torch.randn(1, k, generator=gen), torch.randn(n, k, generator=gen) / k**0.5
    b = torch.randn(n, generator=gen) if bias else None
    torch.testing.assert_close(gemv(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_gemv_config_follows_the_measured_shapes():
    # (N, K) of the Qwen3-4B and Llama-3.1-8B modules -> the H100's fastest configurations.
    assert gemv_config(6144, 2560) == (64, 256, 4, 3)  # Qwen3-4B qkv_proj
    assert gemv_config(2560, 4096) == (32, 256, 4, 5)  # o_proj
    assert gemv_config(19456, 2560) == (32, 512, 4, 3)  # gate_up_proj
    assert gemv_config(2560, 9728) == (32, 512, 4, 5)  # down_proj
    assert gemv_config(6144, 4096) == (64, 256, 4, 3)  # Llama-3.1-8B qkv_proj
    assert gemv_config(4096, 4096) == (64, 256, 4, 5)  # o_proj
    assert gemv_config(28672, 4096) == (64, 256, 4, 3)  # gate_up_proj
    assert gemv_config(4096, 14336) == (64, 256, 4, 5)  # down_proj


@pytest.mark.parametrize("switch,mode,rows,taken", [(True, "triton", 1, True), (True, "triton", 2, False),
                                                   (False, "triton", 1, False), (True, "torch", 1, False)])
def test_linear_takes_the_gemv_for_one_row_only(switch, mode, rows, taken, monkeypatch):
    monkeypatch.setattr(gemv_mod, "ONE_ROW_GEMV", switch)
    calls = count_calls(monkeypatch, gemv_mod, "gemv")
    x, w = torch.randn(rows, 32), torch.randn(48, 32)
    with fused_kernels(mode):
        torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert calls == [int(taken)]


def _decode(switch: bool, monkeypatch, steps: int = 4):
    monkeypatch.setattr(gemv_mod, "ONE_ROW_GEMV", switch)
    calls = count_calls(monkeypatch, gemv_mod, "gemv")
    runner = make_runner(tiny_checkpoint("qwen3"))
    driver = EngineDriver(runner)
    seq = driver.add([5, 9, 13, 200, 7, 3, 99])
    with fused_kernels("triton"):
        tokens, logprobs = greedy_decode_one(driver, seq, driver.extend([seq]), steps, calls)
    return tokens, logprobs, calls, runner


def test_one_request_decode_with_the_gemv_equals_the_default(monkeypatch):
    tokens, logprobs, calls, runner = _decode(True, monkeypatch)
    ref_tokens, ref_logprobs, ref_calls, _ = _decode(False, monkeypatch)
    layers = runner.model_config.hf_config["num_hidden_layers"]
    # qkv_proj, o_proj, gate_up_proj and down_proj of every layer (the LM head is not a linear
    # layer of these), at every decode step and never at the prefill.
    assert calls == [0] + [4 * layers] * 4, calls
    assert ref_calls == [0] * 5
    assert tokens == ref_tokens
    torch.testing.assert_close(logprobs, ref_logprobs, rtol=0, atol=1e-5)
