"""Tiny HF models and real PEFT adapters for the LoRA tests (written by `peft` itself)."""

from __future__ import annotations

import json
import os
from typing import Optional, Sequence, Union

import torch

from sglang.srt.lora.lora_config import PEFT_PROJECTIONS

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=256,
)


def tiny_hf_config(arch: str = "llama", **overrides):
    from transformers import LlamaConfig, Qwen3Config

    kw = dict(TINY, **overrides)
    if arch == "llama":
        return LlamaConfig(**kw)
    if arch == "qwen3":
        kw.setdefault("head_dim", 16)
        return Qwen3Config(**kw)
    raise ValueError(arch)


def tiny_hf_model(arch: str = "llama", seed: int = 0, **overrides):
    from transformers import LlamaForCausalLM, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_hf_config(arch, **overrides)
    cls = LlamaForCausalLM if arch == "llama" else Qwen3ForCausalLM
    return cls(cfg).eval()


def write_peft_adapter(
    out_dir: str,
    r: int = 8,
    lora_alpha: Optional[float] = None,
    target_modules: Union[str, Sequence[str]] = PEFT_PROJECTIONS,
    arch: str = "llama",
    seed: int = 1,
    b_std: float = 0.1,
    base_model=None,
    safe_serialization: bool = True,
    **lora_kwargs,
) -> str:
    """Save a PEFT LoRA adapter for a tiny model; A and B are random and non-zero.

    `b_std` scales B so that the adapter visibly moves the outputs (PEFT's default B is zero).
    """
    from peft import LoraConfig, get_peft_model

    model = base_model if base_model is not None else tiny_hf_model(arch, seed=0)
    cfg = LoraConfig(
        r=r,
        lora_alpha=lora_alpha if lora_alpha is not None else 2 * r,
        target_modules=target_modules if isinstance(target_modules, str) else list(target_modules),
        init_lora_weights=False,
        lora_dropout=0.0,
        **lora_kwargs,
    )
    peft_model = get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".lora_A." in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            elif ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * b_std)
    peft_model.save_pretrained(out_dir, safe_serialization=safe_serialization)
    return out_dir


def edit_adapter_config(path: str, **changes) -> None:
    file = os.path.join(path, "adapter_config.json")
    with open(file) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(file, "w") as f:
        json.dump(cfg, f)


def peft_tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "adapter_model.safetensors"))


def peft_weight(tensors: dict[str, torch.Tensor], layer: int, proj: str, ab: str) -> torch.Tensor:
    parent = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return tensors[f"base_model.model.model.layers.{layer}.{parent}.{proj}.lora_{ab}.weight"]


def two_adapter_assets(root) -> tuple[str, dict[str, str]]:
    """A small Qwen3 checkpoint and two PEFT adapters on it: `a` (rank 8, every module) and `b`
    (rank 4, q/v/up only), the fixtures of the fused-norm and GEMM-shrink tests."""
    from helpers import hf_model, tiny_checkpoint

    ckpt = tiny_checkpoint("qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    return ckpt, {
        "a": write_peft_adapter(str(root / "a"), r=8, base_model=hf_model(ckpt), seed=7),
        "b": write_peft_adapter(str(root / "b"), r=4, target_modules=["q_proj", "v_proj", "up_proj"],
                                base_model=hf_model(ckpt), seed=8),
    }
