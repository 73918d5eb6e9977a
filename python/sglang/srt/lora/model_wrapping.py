"""Where LoRA meets the built model: its target layers, their shapes, the folded base weights, and
the wrappers put around them (run once, by the LoRA manager, after the weights are loaded)."""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Iterable, Optional

import torch
from torch import nn

from sglang.srt.lora.fold_model import fold_base_layers, foldable_modules
from sglang.srt.lora.layers import BaseLayerWithLoRA, get_lora_layer
from sglang.srt.lora.lora import LoRAModelShapes, LoRAModuleShape, module_shape
from sglang.srt.lora.lora_config import SUPPORTED_LORA_MODULES
from sglang.srt.lora.utils import LoRAModuleSpec, LoRAModuleWeights

if TYPE_CHECKING:
    from sglang.srt.lora.backend.base_backend import BaseLoRABackend
    from sglang.srt.lora.mem_pool import LoRAMemoryPool

logger = logging.getLogger(__name__)

_MODULE_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:.*\.)?(" + "|".join(SUPPORTED_LORA_MODULES) + r")$")


def find_lora_target_layers(model: nn.Module) -> dict[str, dict[int, str]]:
    """module kind -> layer id -> full module name, for every fused linear LoRA can wrap."""
    found: dict[str, dict[int, str]] = {}
    for name, _ in model.named_modules():
        m = _MODULE_NAME.search(name)
        if m is not None:
            found.setdefault(m.group(2), {})[int(m.group(1))] = name
    return found


def model_shapes(model: nn.Module, num_layers: Optional[int] = None) -> LoRAModelShapes:
    """The LoRA-relevant shapes, read from the built model's linear layers."""
    found = find_lora_target_layers(model)
    if not found:
        raise ValueError(
            "The model has no layers.{i}.(qkv_proj|o_proj|gate_up_proj|down_proj) modules for LoRA"
        )
    n = num_layers or 1 + max(i for per_layer in found.values() for i in per_layer)
    modules: dict[str, LoRAModuleShape] = {}
    for kind, per_layer in found.items():
        shapes = set()
        for name in per_layer.values():
            layer = model.get_submodule(name)
            if isinstance(layer, BaseLayerWithLoRA):
                layer = layer.base_layer
            shapes.add(module_shape(layer))
        assert len(shapes) == 1, f"{kind} differs across layers: {shapes}"
        modules[kind] = shapes.pop()
    return LoRAModelShapes(num_layers=n, modules=modules)


def fold_candidates(model: nn.Module, target_modules: Iterable[str], dtype: torch.dtype) -> list[str]:
    """Modules whose adapters may be folded into the base GEMM (the pool applies the rule)."""
    return foldable_modules(model, find_lora_target_layers(model), target_modules, dtype)


def fold_base_weights(model: nn.Module, pool: "LoRAMemoryPool", shapes: LoRAModelShapes, dtype: torch.dtype) -> None:
    """Re-lay every folded module's base weight as W_aug (held by the pool; its extra columns
    are the pool's B). Runs once, before any graph capture; W_aug is never reallocated."""
    found = find_lora_target_layers(model)
    for module in pool.target_modules:
        if module not in pool.fold_modules:
            logger.info("LoRA %s: separate shrink and expand kernels (not folded)", module)
            continue
        fold_base_layers(model, found[module], pool, module)
        shape = shapes.modules[module]
        extra = pool.fold_extra_columns(module)
        mib = shape.out_dim * extra * dtype.itemsize / 2**20
        logger.info(
            "LoRA %s: folded into the base GEMM, W_aug [%d, %d + %d] (+%.1f MiB read per layer and forward)%s",
            module, shape.out_dim, shape.in_dim, extra, mib,
            "" if module not in pool.a_fold_modules else ", with A as rows past it for small decode batches (A-fold)"
            if module in pool.Bt_buffer else ", with A as rows past it for prefills (A-fold)",
        )


def wrap_lora_modules(
    model: nn.Module, pool: "LoRAMemoryPool", shapes: LoRAModelShapes, backend: "BaseLoRABackend",
    dtype: torch.dtype,
) -> dict[int, dict[str, BaseLayerWithLoRA]]:
    """Replace every target layer by its LoRA wrapper reading the pool's views; layer id ->
    module kind -> wrapper. The backend learns every module kind (`init_modules`)."""
    found = find_lora_target_layers(model)
    wrapped: dict[int, dict[str, BaseLayerWithLoRA]] = {}
    specs: dict[str, LoRAModuleSpec] = {}
    for module in pool.target_modules:
        shape = shapes.modules[module]
        folded = module in pool.fold_modules
        spec = specs[module] = LoRAModuleSpec(
            module, shape.in_dim, tuple(shape.out_sizes), pool.max_lora_rank,
            pool.fold_extra_columns(module) if folded else 0,
            a_row_stride=pool.A_buffer[module][0].stride(1) if shapes.num_layers else shape.in_dim,
        )
        # Launches are prepared against the spec's A layout (token_backend._layout_tensors).
        assert all(a.stride(1) == spec.a_row_stride and a.stride(2) == 1 for a in pool.A_buffer[module]), module
        for layer_id, name in sorted(found.get(module, {}).items()):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            current = getattr(parent, child)
            if isinstance(current, BaseLayerWithLoRA):  # wrapped already (a second manager)
                current = current.base_layer
            wrapper = get_lora_layer(current, backend)
            wrapper.set_lora_info(
                LoRAModuleWeights(
                    spec,
                    pool.A_buffer[module][layer_id],
                    pool.B_buffer[module][layer_id],
                    wrapper.backend_bias,
                    pool.folded_weight[module][layer_id] if folded else None,
                    # A bias has no place in the GEMM over [W; A]: such a layer keeps the B fold.
                    a_folded=(pool.a_folded_weight[module][layer_id]
                              if module in pool.a_fold_modules and wrapper.backend_bias is None else None),
                    bt=pool.Bt_buffer[module][layer_id] if module in pool.Bt_buffer else None,
                )
            )
            setattr(parent, child, wrapper)
            wrapped.setdefault(layer_id, {})[module] = wrapper
    backend.init_modules(specs, pool.slot_ranks_device, pool.slot_scalings_device, dtype)
    return wrapped
