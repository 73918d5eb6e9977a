"""The folded GEMMs of a one-row decode batch (triton_ops/fold_gemv.py: SGLANG_LORA_FOLD_GEMV for
the B fold, SGLANG_LORA_AFOLD_GEMV for the A fold). CPU, TRITON_INTERPRET=1, float32.

The kernel reads W_aug's first K columns and the row's own slot block, nothing else: the other
slots' blocks hold values here (x_aug's and W_aug's both), so a kernel that read them would be
off by their product. The base model's slot and idle rows (-1) get the base GEMM alone. Through
the model: a one-request decode takes it at every step and only there, and equals cuBLAS's folded
GEMM (SGLANG_LORA_FOLD_GEMV=0) to float32 rounding, for either adapter. The A fold's GEMV reads
W's rows and the row's slot's rows of A, and writes zeros for the other slots' shrink; through the
model it serves o_proj and down_proj (where a norm follows) and equals cuBLAS's GEMM likewise."""

from __future__ import annotations

import pytest
import torch

import sglang.srt.lora.backend.token_backend as token_backend
from helpers import EngineDriver, count_calls, greedy_decode_one, make_runner
from lora_testlib import two_adapter_assets
from sglang.srt.lora.triton_ops.fold_gemv import a_fold_gemv, fold_gemv

SLOTS = 3  # adapter slots with a block; slot 3 is the base model's


@pytest.mark.parametrize("n,k,stack,rank,bias", [(40, 300, 1, 16, False), (96, 64, 2, 8, True),
                                                 (72, 520, 3, 16, False)])
@pytest.mark.parametrize("slot", [0, 2, SLOTS, -1])
def test_fold_gemv_reads_w_and_the_rows_slot_block_only(n, k, stack, rank, bias, slot):
    gen = torch.Generator().manual_seed(n + slot)
    cols = stack * rank
    extra = SLOTS * cols + 16  # and alignment padding past the blocks, as the pool may add
    w_aug = torch.randn(n, k + extra, generator=gen)
    x_aug = torch.randn(1, k + extra, generator=gen)  # every block non-zero: only the row's may count
    b = torch.randn(n, generator=gen) if bias else None
    got = fold_gemv(x_aug, w_aug, k, torch.tensor([slot], dtype=torch.int32), SLOTS, cols, b)

    expected = x_aug[:, :k] @ w_aug[:, :k].T
    if 0 <= slot < SLOTS:
        block = slice(k + slot * cols, k + (slot + 1) * cols)
        expected = expected + x_aug[:, block] @ w_aug[:, block].T
    if b is not None:
        expected = expected + b
    assert got.shape == (1, n)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


def test_fold_gemv_rejects_a_batch_of_two_rows():
    with pytest.raises(AssertionError):
        fold_gemv(torch.zeros(2, 48), torch.zeros(8, 48), 32, torch.zeros(1, dtype=torch.int32), 1, 16)


@pytest.mark.parametrize("n,k,rank", [(40, 300, 16), (100, 520, 8), (16, 64, 16)])
@pytest.mark.parametrize("slot", [0, 2, SLOTS, -1])
def test_a_fold_gemv_reads_w_and_the_rows_slot_rows_of_a_only(n, k, rank, slot):
    gen = torch.Generator().manual_seed(10 * n + slot)
    w_a = torch.randn(n + SLOTS * rank, k, generator=gen)  # [W; A of every slot]
    x = torch.randn(1, k, generator=gen)
    got = a_fold_gemv(x, w_a, n, torch.tensor([slot], dtype=torch.int32), rank)

    expected = torch.zeros(1, n + SLOTS * rank)
    expected[:, :n] = x @ w_a[:n].T
    if 0 <= slot < SLOTS:
        rows = slice(n + slot * rank, n + (slot + 1) * rank)
        expected[:, rows] = x @ w_a[rows].T
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return two_adapter_assets(tmp_path_factory.mktemp("fold-gemv"))


def _decode_one(assets, backend: str, gemv: str, name, monkeypatch, steps: int = 4, counted: str = "fold_gemv",
                switch: str = "SGLANG_LORA_FOLD_GEMV"):
    """One request (adapter `name`): its decode tokens and logprobs, and how many calls of
    token_backend's `counted` the prefill and each decode step made, with `switch` set to `gemv`."""
    monkeypatch.setenv(switch, gemv)  # read when the backend is built
    ckpt, paths = assets
    runner = make_runner(ckpt, lora_paths=[f"{n}={p}" for n, p in paths.items()], lora_backend=backend,
                         max_lora_rank=8)
    calls = count_calls(monkeypatch, token_backend, counted)  # [the prefills', then a step's each]
    ids = {r.lora_name: i for i, r in runner.lora_manager.refs.items()}
    driver = EngineDriver(runner)
    # The other adapter's request prefills first, so that it takes the pool's first slot and `name`
    # the second (a kernel reading slot 0's block for every row would miss its delta); only
    # `name`'s request decodes.
    driver.extend([driver.add([11, 4, 250], lora_id=ids["b" if name == "a" else "a"])])
    seq = driver.add([5, 9, 13, 200, 7, 3, 99], lora_id=ids[name])
    out = driver.extend([seq])
    assert runner.lora_manager.pool.lora_id_to_slot[ids[name]] == 1
    tokens, logprobs = greedy_decode_one(driver, seq, out, steps, calls)
    return tokens, logprobs, calls


@pytest.mark.parametrize("backend", ["triton", "csgmv"])
@pytest.mark.parametrize("name", ["a", "b"])
def test_one_row_decode_takes_the_gemv_and_equals_cublas(assets, backend, name, monkeypatch):
    """(A lone base-model request runs no LoRA kernel in eager; under a graph its row has the base
    slot, which the kernel test covers.)"""
    tokens, logprobs, calls = _decode_one(assets, backend, "1", name, monkeypatch)
    ref_tokens, ref_logprobs, ref_calls = _decode_one(assets, backend, "0", name, monkeypatch)
    # qkv_proj and gate_up_proj of both layers, and the last layer's down_proj (no norm after it
    # to defer to: the others and o_proj take the A-fold at small decode batches); never at the
    # prefill, nor with the switch off.
    assert calls == [0] + [5] * 4, calls
    assert ref_calls == [0] * 5
    assert tokens == ref_tokens
    torch.testing.assert_close(logprobs, ref_logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("backend", ["triton", "csgmv"])
def test_one_row_decode_takes_the_a_fold_gemv_and_equals_cublas(assets, backend, monkeypatch):
    kw = dict(counted="a_fold_gemv", switch="SGLANG_LORA_AFOLD_GEMV")
    tokens, logprobs, calls = _decode_one(assets, backend, "1", "b", monkeypatch, **kw)
    ref_tokens, ref_logprobs, ref_calls = _decode_one(assets, backend, "0", "b", monkeypatch, **kw)
    # o_proj of both layers and the first layer's down_proj (the last one's has no norm after it);
    # off by default.
    assert calls == [0] + [3] * 4, calls
    assert ref_calls == [0] * 5
    assert tokens == ref_tokens
    torch.testing.assert_close(logprobs, ref_logprobs, rtol=0, atol=1e-5)
