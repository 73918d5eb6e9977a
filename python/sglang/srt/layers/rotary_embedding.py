"""Rotary position embedding (RoPE), the "rotate half" layout of Llama/Qwen checkpoints.

cos/sin are computed once, in float32, for every position up to `max_position` and kept on the
device. `forward` takes the fused qkv projection output: on the Triton path one kernel rotates q
and k in place (with Qwen3's q/k RMSNorm before it and, when asked, the KV-cache store after it,
see triton_ops/rope.py); the torch reference gathers cos/sin rows with `index_select`. Neither has
host syncs or data-dependent shapes, so both can be captured in a CUDA graph.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.triton_ops.dispatch import use_triton
from sglang.srt.layers.triton_ops.rope import KVStore, QKNormWeights, qkv_rope_fwd


def _wavelength_powers(rotary_dim: int, base: float) -> torch.Tensor:
    """base^(2i / rotary_dim) for each pair i: the inverse frequencies' denominators."""
    # On the host whatever the default device, so every device gets bit-identical frequencies.
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / rotary_dim
    return base**exponents


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths are divided by `factor`, short ones kept, and
    the band in between is interpolated smoothly between the two."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(powers: torch.Tensor, base: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071), as Qwen2.5/Qwen3 use it past their pre-training context: pairs that
    turn many times within the old context keep their frequency (extrapolated), pairs that turn
    less than once are divided by `factor` (interpolated), and a linear ramp over the pair index
    blends the band in between. cos/sin are then scaled by the attention factor (0.1 ln(factor) + 1
    unless the config gives it), which restores the attention entropy the stretch lowers."""
    rotary_dim = 2 * powers.numel()
    factor = float(scaling["factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def pair_index(rotations: float) -> float:
        # The pair whose wavelength fits `rotations` times into the old context.
        return rotary_dim * math.log(old_context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_index(beta_fast), pair_index(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    pairs = torch.arange(rotary_dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((pairs - low) / (high - low)).clamp(0, 1)  # 0: extrapolate, 1: interpolate
    keep = 1 - ramp
    inv_freq = 1.0 / (factor * powers) * (1 - keep) + 1.0 / powers * keep

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:  # DeepSeek's form: a ratio of two such factors
            attention_factor = _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    return inv_freq, float(attention_factor)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def rope_frequencies(rotary_dim: int, base: float, rope_scaling: Optional[dict]) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim / 2], the factor cos and sin are multiplied by).

    `rope_scaling` is ModelConfig's: None or a dict with a supported `rope_type` (for yarn, with
    `factor` and `original_max_position_embeddings` filled in)."""
    powers = _wavelength_powers(rotary_dim, base)
    inv_freq = 1.0 / powers
    if rope_scaling is None:
        return inv_freq, 1.0
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(powers, base, rope_scaling)
    if rope_type == "default":
        return inv_freq, 1.0
    raise ValueError(f"unsupported rope scaling type {rope_type!r}")


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_size: int,
        max_position: int,
        base: float = 10000.0,
        rope_scaling: Optional[dict] = None,
        rotary_dim: Optional[int] = None,
    ) -> None:
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim or head_size
        self.max_position = max_position
        if self.rotary_dim % 2 != 0 or self.rotary_dim > head_size:
            raise ValueError(f"invalid rotary_dim {self.rotary_dim} for head size {head_size}")
        inv_freq, scale = rope_frequencies(self.rotary_dim, base, rope_scaling)
        # Built on the current default device (the loader builds models under the target device).
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq.to(positions.device))
        cos, sin = freqs.cos(), freqs.sin()
        if scale != 1.0:  # yarn: scaled in float32 before any cast, as transformers does
            cos, sin = cos * scale, sin * scale
        # [max_position, 2 * rotary_dim], float32 whatever the model dtype: [cos | cos] then
        # [-sin | sin], so that x * cos + swap_halves(x) * sin is the rotation in four kernels.
        self.register_buffer(
            "cos_sin_cache", torch.cat((cos, cos, -sin, sin), dim=-1), persistent=False
        )

    def forward(
        self,
        positions: torch.Tensor,
        qkv: torch.Tensor,
        num_q_heads: int,
        num_kv_heads: int,
        q_norm: Optional[RMSNorm] = None,
        k_norm: Optional[RMSNorm] = None,
        kv_store: Optional[KVStore] = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
        """qkv [T, (q + 2 kv heads) * head_size] -> (q, k, v, whether K/V were stored).

        q and k are normalised per head by `q_norm` / `k_norm` when given (Qwen3), then rotated.
        The Triton path works in place on `qkv` (q, k, v are views of it) and writes K/V into
        `kv_store` when given; the torch reference returns new q and k and never stores (the
        attention layer then does).
        """
        q_size, kv_size = num_q_heads * self.head_size, num_kv_heads * self.head_size
        if use_triton(qkv):
            norm = None
            if q_norm is not None:
                norm = QKNormWeights(q_norm.weight, k_norm.weight, q_norm.variance_epsilon)
            qkv_rope_fwd(
                qkv, positions, self.cos_sin_cache, num_q_heads, num_kv_heads, self.head_size,
                self.rotary_dim, qk_norm=norm, kv_store=kv_store,
            )
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            return q, k, v, kv_store is not None
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        if q_norm is not None:
            q = q_norm.forward_torch(q.unflatten(-1, (num_q_heads, self.head_size))).flatten(-2)
            k = k_norm.forward_torch(k.unflatten(-1, (num_kv_heads, self.head_size))).flatten(-2)
        q, k = self.forward_torch(positions, q, k)
        return q, k, v, False

    def forward_torch(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference rotation (CPU path, test oracle): query [T, heads * head_size], key
        [T, kv_heads * head_size] -> rotated, same shapes."""
        cos_sin = self.cos_sin_cache.index_select(0, positions).to(query.dtype)
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)  # [T, 1, rotary_dim] each
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # The HF reference computes x * cos + cat(-x2, x1) * sin; with the sign folded into the
        # cached sin this is bit-identical (negation is exact), in fewer kernels.
        shape = x.shape
        x = x.view(shape[0], -1, self.head_size)
        rot, passthrough = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        x1, x2 = rot.chunk(2, dim=-1)
        out = rot * cos + torch.cat((x2, x1), dim=-1) * sin
        if passthrough.shape[-1]:
            out = torch.cat((out, passthrough), dim=-1)
        return out.reshape(shape)

    def extra_repr(self) -> str:
        return f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, max_position={self.max_position}"


def get_rope(
    head_size: int,
    max_position: int,
    base: float,
    rope_scaling: Optional[dict] = None,
    rotary_dim: Optional[int] = None,
) -> RotaryEmbedding:
    return RotaryEmbedding(head_size, max_position, base, rope_scaling, rotary_dim)
