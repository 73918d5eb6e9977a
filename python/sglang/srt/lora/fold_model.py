"""The model's side of folding (lora/fold.py): which base layers can fold, and re-laying their weights.

A folded module's forward becomes `F.linear(x_aug, W_aug, bias)` in the LoRA backend, so only base
layers whose own forward is exactly that GEMM qualify: LinearBase's (the column-parallel layers at
any tp_size: each rank's output rows, nothing reduced), and a row-parallel layer's, whose LoRA
wrapper folds the rank's partial product (its input slice, rank 0's bias) and all-reduces the
folded GEMM's output, as the base layer all-reduces its own (lora/layers.py). Re-laying
makes the base layer's `weight` the view W_aug[:, :K]: whatever reads `.weight` keeps working, a
batch without LoRA runs the base layer unchanged (a strided weight, the same GEMM), and the old
W is freed layer by layer as soon as it is copied.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch
from torch import nn

from sglang.srt.layers.linear import LinearBase, RowParallelLinear

if TYPE_CHECKING:
    from sglang.srt.lora.mem_pool import LoRAMemoryPool


def _base(layer: nn.Module) -> nn.Module:
    return getattr(layer, "base_layer", layer)  # a LoRA wrapper of an earlier manager


def _plain_linear(layer: nn.Module, dtype: torch.dtype) -> bool:
    forward = type(layer).forward
    return (forward is LinearBase.forward or forward is RowParallelLinear.forward) and layer.weight.dtype == dtype


def foldable_modules(
    model: nn.Module, found: dict[str, dict[int, str]], target_modules: Iterable[str], dtype: torch.dtype
) -> list[str]:
    """Target modules every layer of which is a plain `F.linear` of `dtype`."""
    out = []
    for module in sorted(target_modules):
        layers = [_base(model.get_submodule(name)) for name in found.get(module, {}).values()]
        if layers and all(_plain_linear(layer, dtype) for layer in layers):
            out.append(module)
    return out


@torch.no_grad()
def fold_base_layers(model: nn.Module, layer_names: dict[int, str], pool: "LoRAMemoryPool", module: str) -> None:
    """Give every layer of `module` its W_aug (built by the pool) and make its weight the view."""
    for layer_id, name in sorted(layer_names.items()):
        layer = _base(model.get_submodule(name))
        w_aug = pool.fold_base_weight(module, layer_id, layer.weight.data)
        weight = nn.Parameter(w_aug[:, : layer.weight.shape[1]], requires_grad=False)
        loader = getattr(layer.weight, "weight_loader", None)
        if loader is not None:
            weight.weight_loader = loader
        layer.weight = weight
