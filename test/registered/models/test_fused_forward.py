"""A whole tiny model forward through the fused Triton kernels (forced, interpreted on CPU) equals
the torch reference path: float32, prompt logprobs of a mixed batch, then decode steps.

The fused RoPE kernel also stores K/V, so the attention backend (torch_native: it reads every key
from the pool) only sees correct keys if the store wrote the right slots.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import EngineDriver, make_runner, tiny_checkpoint

from sglang.srt.layers.triton_ops.dispatch import fused_kernels

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (set by conftest without CUDA)"
)

CHECKPOINTS = {
    # Llama: llama3 rope scaling, biases on every projection.
    "llama": dict(attention_bias=True, mlp_bias=True,
                  rope_scaling=dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=64)),
    # Qwen3: per-head q/k norm, head_dim != hidden / heads.
    "qwen3": dict(),
}
PROMPTS = ([5, 17, 99, 3, 250, 31, 8, 64, 12], [400, 2, 77, 150, 9, 11])


def _run(runner, mode: str):
    driver = EngineDriver(runner)
    with fused_kernels(mode):
        seqs = [driver.add(list(p)) for p in PROMPTS]
        prefill = driver.extend(seqs, logprob_start=0)
        decode_lps = []
        out = prefill
        for _ in range(3):
            for seq, tok in zip(seqs, out.next_token_ids.tolist()):
                seq.tokens.append(tok)
            out = driver.decode(seqs, return_logprob=True)
            decode_lps.append(out.next_token_logprobs)
        tokens = [s.tokens for s in seqs]
        for seq in seqs:
            driver.release(seq)
    return prefill.input_token_logprobs, tokens, decode_lps


@pytest.mark.parametrize("arch", sorted(CHECKPOINTS))
def test_triton_forward_equals_torch_forward(arch: str) -> None:
    runner = make_runner(tiny_checkpoint(arch, **CHECKPOINTS[arch]), attention_backend="torch_native")
    ref_lps, ref_tokens, ref_decode = _run(runner, "torch")
    lps, tokens, decode = _run(runner, "triton")
    assert tokens == ref_tokens
    for got, ref in zip(lps, ref_lps):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), atol=2e-5, rtol=0)
    torch.testing.assert_close(torch.tensor(decode), torch.tensor(ref_decode), atol=2e-5, rtol=0)
