"""The fused layer kernels (layers/triton_ops) against their torch references, under
TRITON_INTERPRET=1 on CPU at small shapes.

float32 within 1e-5; bfloat16 bit for bit (the kernels round in the references' order; the
interpreter's truncating float32 -> bfloat16 cast is corrected by `cast_rne`). Shapes cover hidden
sizes that are not powers of two, even head dims that are not multiples of 16, GQA ratios 1/2/4,
with and without a residual, Llama-3 rope scaling past 4096 positions, partial rotary dims, and the
fused KV store (including the dummy slot 0 that padded tokens write).
"""

from __future__ import annotations

import os

import pytest
import torch

from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.rotary_embedding import RotaryEmbedding
from sglang.srt.layers.triton_ops.dispatch import ENV_VAR, fused_kernels, fused_kernels_mode, use_triton
from sglang.srt.layers.triton_ops.rmsnorm import rmsnorm_fwd
from sglang.srt.layers.triton_ops.rope import KVStore, QKNormWeights, qkv_rope_fwd
from sglang.srt.layers.triton_ops.silu_and_mul import silu_and_mul_fwd

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="Triton kernels on CPU tensors need TRITON_INTERPRET=1 (set by conftest without CUDA)",
)

DTYPES = (torch.float32, torch.bfloat16)
LLAMA3_SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=1024)


def assert_matches(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    else:
        # Same roundings in the same order: equal, not merely close.
        assert torch.equal(got, ref), (got.float() - ref.float()).abs().max()


def _norm(n: int, dtype: torch.dtype, gen: torch.Generator, eps: float = 1e-6) -> RMSNorm:
    norm = RMSNorm(n, eps)
    norm.weight.data = (1 + 0.3 * torch.randn(n, generator=gen)).to(dtype)
    return norm


# ---------------------------------------------------------------------------------- RMSNorm
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 896, 2560])
def test_rmsnorm_matches_reference(hidden: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(hidden)
    norm = _norm(hidden, dtype, gen)
    x = (3 * torch.randn(7, hidden, generator=gen)).to(dtype)
    res = torch.randn(7, hidden, generator=gen).to(dtype)

    assert_matches(rmsnorm_fwd(x, norm.weight, norm.variance_epsilon), norm.forward_torch(x))

    ref_out, ref_res = norm.forward_torch(x, res)
    x_in, res_in = x.clone(), res.clone()
    with fused_kernels("triton"):
        out, new_res = norm(x_in, res_in)
    # In place: the sum went into the residual buffer, the normalised rows into x's.
    assert out is x_in and new_res is res_in
    assert_matches(out, ref_out)
    assert_matches(new_res, ref_res)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_weight_first_gives_the_same_bits(dtype: torch.dtype, monkeypatch) -> None:
    """WEIGHT_FIRST loads the weight with the row, before the reduction: the same values, bit for
    bit, with and without a residual (whose new value the kernel writes back first)."""
    from sglang.srt.layers.triton_ops import rmsnorm

    gen = torch.Generator().manual_seed(5)
    norm = _norm(2560, dtype, gen)
    x = (3 * torch.randn(5, 2560, generator=gen)).to(dtype)
    res = torch.randn(5, 2560, generator=gen).to(dtype)
    outs = {}
    for first in (False, True):
        monkeypatch.setattr(rmsnorm, "WEIGHT_FIRST", first)
        r = res.clone()
        outs[first] = (rmsnorm_fwd(x, norm.weight, norm.variance_epsilon),
                       rmsnorm_fwd(x, norm.weight, norm.variance_epsilon, residual=r), r)
    for old, new in zip(outs[False], outs[True]):
        assert torch.equal(old, new)
    assert_matches(outs[True][0], norm.forward_torch(x))


def test_rmsnorm_without_residual_keeps_its_input_and_handles_3d() -> None:
    gen = torch.Generator().manual_seed(1)
    norm = _norm(96, torch.float32, gen)
    x = torch.randn(2, 3, 96, generator=gen)
    keep = x.clone()
    with fused_kernels("triton"):
        out = norm(x)
    assert torch.equal(x, keep) and out.shape == x.shape
    assert_matches(out, norm.forward_torch(x))


# ---------------------------------------------------------------------------------- SiLU-and-mul
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 896, 2560])
def test_silu_and_mul_matches_reference(d: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(d)
    x = (3 * torch.randn(5, 2 * d, generator=gen)).to(dtype)
    assert_matches(silu_and_mul_fwd(x), SiluAndMul.forward_torch(x))
    with fused_kernels("triton"):
        assert_matches(SiluAndMul()(x), SiluAndMul.forward_torch(x))


# ---------------------------------------------------------------------------------- RoPE (+ norm, + store)
def _reference_qkv(rope: RotaryEmbedding, positions, qkv, heads, kv_heads, q_norm, k_norm):
    d = rope.head_size
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    if q_norm is not None:
        q = q_norm.forward_torch(q.unflatten(-1, (heads, d))).flatten(-2)
        k = k_norm.forward_torch(k.unflatten(-1, (kv_heads, d))).flatten(-2)
    q, k = rope.forward_torch(positions, q, k)
    return q, k, v


ROPE_CASES = [
    # heads, kv_heads, head_dim, rotary_dim, qk_norm, llama3 scaling
    (4, 4, 16, None, False, False),  # GQA 1
    (4, 2, 40, None, True, False),  # GQA 2, head_dim 40 (not a multiple of 16), Qwen3 norm
    (8, 2, 72, None, True, True),  # GQA 4, head_dim 72, norm, llama3 scaling
    (4, 1, 64, 32, True, False),  # partial rotary with the norm over the whole head
    (4, 2, 64, 48, False, True),  # partial rotary, 24-wide halves, llama3 scaling
]


@pytest.mark.parametrize("loc_first", [False, True])  # rope.LOC_FIRST: the slot loaded at the start
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,rotary_dim,qk_norm,llama3", ROPE_CASES)
def test_qkv_rope_matches_reference_and_stores_kv(heads, kv_heads, head_dim, rotary_dim, qk_norm, llama3, dtype,
                                                   loc_first, monkeypatch):
    from sglang.srt.layers.triton_ops import rope as rope_ops

    monkeypatch.setattr(rope_ops, "LOC_FIRST", loc_first)
    gen = torch.Generator().manual_seed(heads * 1000 + head_dim)
    max_pos = 8192 if llama3 else 256
    rope = RotaryEmbedding(head_dim, max_pos, 500000.0 if llama3 else 10000.0,
                           LLAMA3_SCALING if llama3 else None, rotary_dim)
    num_tokens, slots = 6, 16
    qkv = (2 * torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)).to(dtype)
    # Positions past 4096 where scaling is on: the long-wavelength band is the scaled one.
    positions = torch.randint(4097 if llama3 else 0, max_pos, (num_tokens,), generator=gen)
    q_norm = k_norm = None
    if qk_norm:
        q_norm, k_norm = _norm(head_dim, dtype, gen), _norm(head_dim, dtype, gen)
    ref_q, ref_k, ref_v = _reference_qkv(rope, positions, qkv, heads, kv_heads, q_norm, k_norm)

    k_buf = torch.zeros(slots + 1, kv_heads, head_dim, dtype=dtype)
    v_buf = torch.zeros_like(k_buf)
    loc = torch.randperm(slots, generator=gen)[:num_tokens] + 1
    loc[-1] = 0  # a padded token: writes the dummy slot
    store = KVStore(k_buf, v_buf, loc)
    work = qkv.clone()
    with fused_kernels("triton"):
        q, k, v, stored = rope(positions, work, heads, kv_heads, q_norm, k_norm, kv_store=store)
    assert stored
    # In place: q, k, v are views of the qkv buffer.
    assert q.data_ptr() == work.data_ptr() and v.data_ptr() == work.data_ptr() + (heads + kv_heads) * head_dim * work.element_size()
    assert_matches(q, ref_q)
    assert_matches(k, ref_k)
    assert torch.equal(v, ref_v)
    # The pool holds the rotated k and the raw v at exactly the tokens' slots, slot 0 included.
    assert_matches(k_buf[loc], ref_k.reshape(num_tokens, kv_heads, head_dim))
    assert torch.equal(v_buf[loc], ref_v.reshape(num_tokens, kv_heads, head_dim))
    untouched = torch.ones(slots + 1, dtype=torch.bool)
    untouched[loc] = False
    assert not k_buf[untouched].any() and not v_buf[untouched].any()


def test_qkv_rope_without_store_leaves_v_and_reports_it() -> None:
    gen = torch.Generator().manual_seed(5)
    rope = RotaryEmbedding(32, 128, 10000.0)
    qkv = torch.randn(3, (4 + 2 * 2) * 32, generator=gen)
    positions = torch.tensor([0, 5, 127])
    ref_q, ref_k, ref_v = _reference_qkv(rope, positions, qkv, 4, 2, None, None)
    with fused_kernels("triton"):
        q, k, v, stored = rope(positions, qkv.clone(), 4, 2)
    assert not stored
    assert_matches(q, ref_q)
    assert_matches(k, ref_k)
    assert torch.equal(v, ref_v)


def test_qkv_rope_rejects_bad_shapes() -> None:
    rope = RotaryEmbedding(16, 32, 10000.0)
    with pytest.raises(ValueError, match="qkv must be"):
        qkv_rope_fwd(torch.zeros(2, 100), torch.zeros(2, dtype=torch.long), rope.cos_sin_cache, 2, 1, 16, 16)
    with pytest.raises(ValueError, match="norm weights"):
        qkv_rope_fwd(torch.zeros(2, 64), torch.zeros(2, dtype=torch.long), rope.cos_sin_cache, 2, 1, 16, 16,
                     qk_norm=QKNormWeights(torch.ones(8), torch.ones(8), 1e-6))


# ---------------------------------------------------------------------------------- dispatch
def test_dispatch_modes() -> None:
    cpu = torch.zeros(1)
    assert fused_kernels_mode() == os.environ.get(ENV_VAR, "auto")
    with fused_kernels("auto"):
        assert not use_triton(cpu)  # the CPU suite keeps the torch references
    with fused_kernels("torch"):
        assert not use_triton(cpu)
    with fused_kernels("triton"):
        assert use_triton(cpu)
    with pytest.raises(ValueError, match="mode must be"):
        with fused_kernels("fast"):
            pass


def test_env_var_is_read_once_and_validated(monkeypatch) -> None:
    from sglang.srt.layers.triton_ops import dispatch

    cpu = torch.zeros(1)
    monkeypatch.setattr(dispatch, "_mode", None)  # as in a fresh process
    monkeypatch.setenv(ENV_VAR, "Triton")
    assert use_triton(cpu) and fused_kernels_mode() == "triton"
    monkeypatch.setenv(ENV_VAR, "torch")
    assert use_triton(cpu)  # read once: a later change of the variable is not seen
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs TRITON_INTERPRET=1"):
        use_triton(cpu)
    monkeypatch.setattr(dispatch, "_mode", None)
    monkeypatch.setenv(ENV_VAR, "bogus")
    with pytest.raises(ValueError, match="SGLANG_FUSED_KERNELS must be one of"):
        use_triton(cpu)
