"""The fused layer kernels against their torch references on the GPU, bf16, at real shapes
(Llama-3.1-8B: hidden 4096, MLP 14336, 32/8 heads x 128, llama3 rope scaling to 131072 positions;
Qwen3-4B: hidden 2560, MLP 9728, 32/8 heads x 128 with q/k norm), 1, 128 and 2048 tokens.

Adds and casts round exactly like the references (the residual sum is compared bit for bit).
Elsewhere the kernels may round differently from torch's op-by-op bf16 arithmetic: the RMSNorm
statistics are reduced in another order and the GPU has fast exp/rsqrt (one float32 bit, which can
flip a bf16 rounding, then doubled by the weight's multiply: up to 2 bf16 ulps on rare elements),
and the RoPE kernel contracts `x*cos + y*sin` into a fused multiply-add (one rounding fewer than
torch's two products and a sum: up to a few ulps on the H200, measured 2026-11-30; where the
difference cancels, ulps of the products' size, see rotary_pair_norm). A real bug (a
wrong position, sign, half or head) moves elements by whole units, far outside these bounds.
"""

from __future__ import annotations

import pytest
import torch

from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.rotary_embedding import RotaryEmbedding
from sglang.srt.layers.triton_ops.rope import KVStore

pytestmark = pytest.mark.gpu

DEV = "cuda"
BF16 = torch.bfloat16
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=8192)
SHAPES = {
    # hidden, intermediate, heads, kv_heads, head_dim, rope base, rope scaling, max position, qk norm
    "llama-3.1-8b": (4096, 14336, 32, 8, 128, 500000.0, LLAMA3, 131072, False),
    "qwen3-4b": (2560, 9728, 32, 8, 128, 1000000.0, None, 40960, True),
}
TOKENS = (1, 128, 2048)


def assert_bf16_close(
    got: torch.Tensor, ref: torch.Tensor, exact: bool = False, ulps: int = 2, max_frac: float = 1e-2,
    scale: torch.Tensor | None = None,
) -> None:
    """Equal, or within `ulps` bf16 ulps everywhere and different on at most `max_frac` of them.
    The ulp is taken at max(|got|, |ref|, scale): `scale` is the magnitude the rounding happened at
    when it exceeds the result's (a difference of products that cancels)."""
    assert got.dtype == ref.dtype == BF16 and got.shape == ref.shape
    if exact:
        assert torch.equal(got, ref), (got.float() - ref.float()).abs().max()
        return
    g, r = got.float(), ref.float()
    mag = torch.maximum(g.abs(), r.abs())
    if scale is not None:
        mag = torch.maximum(mag, scale)
    err = (g - r).abs()
    ok = err <= ulps * (mag * 2.0 ** -7 + 1e-30)
    assert ok.all(), f"{int((~ok).sum())} elements off; worst {float(err.max())}"
    assert (g != r).float().mean().item() <= max_frac


def rotary_pair_norm(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """|(x_i, x_{i+d/2})| for every element of a [tokens, heads*d] rope output (rotate-half pairs).
    A rotation keeps it, and it bounds both products of `x*cos - y*sin`: an output near zero by
    cancellation is rounded at this magnitude, not at its own (measured on the H200: 7e-4 against
    an exact 0 from inputs of size ~2, one ulp of the products)."""
    pairs = x.float().unflatten(-1, (-1, 2, head_dim // 2))
    norm = pairs.square().sum(-2, keepdim=True).sqrt()
    return norm.expand_as(pairs).flatten(-3)


def _norm(n: int, gen: torch.Generator) -> RMSNorm:
    norm = RMSNorm(n, 1e-6).to(DEV)
    norm.weight.data = (1 + 0.3 * torch.randn(n, generator=gen, device=DEV)).to(BF16)
    return norm


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_rmsnorm_and_silu_at_real_shapes(shape: str, tokens: int) -> None:
    hidden, inter = SHAPES[shape][:2]
    gen = torch.Generator(device=DEV).manual_seed(tokens)
    norm = _norm(hidden, gen)
    x = torch.randn(tokens, hidden, generator=gen, device=DEV).to(BF16)
    res = (4 * torch.randn(tokens, hidden, generator=gen, device=DEV)).to(BF16)
    assert_bf16_close(norm(x), norm.forward_torch(x))
    ref_out, ref_res = norm.forward_torch(x, res)
    out, new_res = norm(x.clone(), res.clone())
    assert_bf16_close(new_res, ref_res, exact=True)
    assert_bf16_close(out, ref_out)

    gate_up = (2 * torch.randn(tokens, 2 * inter, generator=gen, device=DEV)).to(BF16)
    assert_bf16_close(SiluAndMul()(gate_up), SiluAndMul.forward_torch(gate_up))

    f32 = x.float()
    torch.testing.assert_close(norm.float()(f32.clone(), res.float().clone())[0],
                               norm.float().forward_torch(f32, res.float())[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_qkv_rope_at_real_shapes(shape: str, tokens: int) -> None:
    _, _, heads, kv_heads, d, base, scaling, max_pos, qk_norm = SHAPES[shape]
    gen = torch.Generator(device=DEV).manual_seed(tokens + 7)
    with torch.device(DEV):
        rope = RotaryEmbedding(d, max_pos, base, scaling)
    qkv = (2 * torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen, device=DEV)).to(BF16)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen, device=DEV)
    q_norm = k_norm = None
    if qk_norm:
        q_norm, k_norm = _norm(d, gen), _norm(d, gen)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    if qk_norm:
        q = q_norm.forward_torch(q.unflatten(-1, (heads, d))).flatten(-2)
        k = k_norm.forward_torch(k.unflatten(-1, (kv_heads, d))).flatten(-2)
    ref_q, ref_k = rope.forward_torch(positions, q, k)

    slots = 4 * tokens + 1
    k_buf = torch.zeros(slots, kv_heads, d, dtype=BF16, device=DEV)
    v_buf = torch.zeros_like(k_buf)
    loc = torch.randperm(slots - 1, device=DEV)[:tokens] + 1
    got_q, got_k, got_v, stored = rope(positions, qkv.clone(), heads, kv_heads, q_norm, k_norm,
                                      kv_store=KVStore(k_buf, v_buf, loc))
    assert stored
    assert_bf16_close(got_q, ref_q, ulps=4, max_frac=0.5, scale=rotary_pair_norm(ref_q, d))
    assert_bf16_close(got_k, ref_k, ulps=4, max_frac=0.5, scale=rotary_pair_norm(ref_k, d))
    assert torch.equal(got_v, v)
    assert torch.equal(k_buf[loc], got_k.reshape(tokens, kv_heads, d))
    assert torch.equal(v_buf[loc], v.reshape(tokens, kv_heads, d))
    assert int((k_buf != 0).any(-1).any(-1).sum()) == tokens
