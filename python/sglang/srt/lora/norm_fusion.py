"""`--lora-fuse-norm` (default auto): at decode, the RMSNorm before qkv_proj and gate_up_proj also
computes the LoRA shrink of the module it feeds (triton_ops/norm_shrink_pack.py), one kernel instead
of two, folded or unfolded. `auto` and `on` fuse the same norms; `on` warns where nothing can fuse.

The norm and the module stay what they are; they meet through two seams:
  - `RMSNorm.fusion` (layers/layernorm.py): a `NormShrinkFusion` that, when this forward fuses
    (a decode batch with LoRA on: `backend.fuses_norm`), runs the norm with the shrink
    (`backend.run_norm`) and returns the normalised rows as the norm's output (and the new
    residual). For a folded module it writes x_aug = [norm(x) | packed shrink] and the rows are
    its view; for an unfolded one, the rows and xa (the shrink the expand reads);
  - `BaseLayerWithLoRA.prepared` (lora/layers.py): the module's next call recognises those rows
    (same address and shape) and runs only the rest: the GEMM over x_aug, or the base GEMM and the
    expand.
Anything else (prefill, LoRA off for the batch, a caller that hands the module another tensor)
takes the unfused path, which computes the same function.

Both decode paths fuse (graph capture and eager decode take the same decision from the batch's
metadata), so graph = eager stays bit for bit. Against the unfused path the norm's output is the
same bits and only the adapters' shrink sums run in another order (float32 accumulation).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.layernorm import NormResult, RMSNorm
from sglang.srt.lora.layers import BaseLayerWithLoRA

if TYPE_CHECKING:
    from sglang.srt.lora.backend.base_backend import BaseLoRABackend

logger = logging.getLogger(__name__)

# (norm attribute of the decoder layer, path of the module it feeds, relative to the layer).
NORM_FED_MODULES = (("input_layernorm", "self_attn.qkv_proj"), ("post_attention_layernorm", "mlp.gate_up_proj"))


class NormShrinkFusion:
    """The `fusion` of one RMSNorm whose output feeds one LoRA module. A plain object, not a
    module: it must not put the target into the norm's module tree."""

    def __init__(self, norm: RMSNorm, target: BaseLayerWithLoRA, backend: "BaseLoRABackend") -> None:
        self.norm, self.target, self.backend = norm, target, backend

    def __call__(self, x: torch.Tensor, residual: Optional[torch.Tensor]) -> Optional[NormResult]:
        target = self.target
        if not target.lora_active or not self.backend.fuses_norm():
            return None
        prepared, new_residual = self.backend.run_norm(target.lora, self.norm.weight, self.norm.variance_epsilon,
                                                       x, residual)
        target.prepared = prepared
        return prepared.normed if residual is None else (prepared.normed, new_residual)


class ActShrinkFusion:
    """The `fusion` of the SiLU-and-mul before down_proj (SGLANG_LORA_ROWWISE_DECODE=1): the
    activation and down_proj's shrink in one kernel."""

    def __init__(self, target: BaseLayerWithLoRA, backend: "BaseLoRABackend") -> None:
        self.target, self.backend = target, backend

    def __call__(self, gate_up: torch.Tensor) -> Optional[torch.Tensor]:
        target = self.target
        if not target.lora_active or not self.backend.rowwise_now() or gate_up.dim() != 2:
            return None
        target.prepared = self.backend.run_act(target.lora, gate_up)
        return target.prepared.normed


def attach_norm_fusion(model: nn.Module, wrapped: dict[int, dict[str, BaseLayerWithLoRA]],
                       module_names: dict[str, dict[int, str]], backend: "BaseLoRABackend") -> int:
    """Set the fusion of every norm that feeds a wrapped qkv_proj / gate_up_proj and, with the
    backend's row-wise decode (SGLANG_LORA_ROWWISE_DECODE), of the SiLU-and-mul before a wrapped
    down_proj; returns how many.

    Before a folded module the fused kernel packs the same x_aug as shrink_pack (the H200 test
    measured the logprobs equal to the unfused engine's, bit for bit). Before an unfolded one its
    shrink reduces row by row where the unfused one uses tensor-core dots: the same function, other
    roundings, no less accurate against the float32 engine (H200, fourth session: max error 0.208
    fused, 0.320 unfused), and 5-6% off a 64-slot decode step, where qkv and gate_up unfold (H200,
    eighth session: 64 requests on 8 / 32 / 64 adapters, 1.44 / 1.52 / 1.69 of the base step ->
    1.36 / 1.45 / 1.63). So the default fuses both."""
    count = 0
    for layer_id, modules in wrapped.items():
        for norm_attr, path in NORM_FED_MODULES:
            kind = path.rsplit(".", 1)[1]
            target = modules.get(kind)
            name = module_names.get(kind, {}).get(layer_id)
            if target is None or name is None or target.lora is None:
                continue
            if not name.endswith("." + path):
                continue  # another layout: leave it unfused
            layer = model.get_submodule(name[: -len(path) - 1])
            norm = getattr(layer, norm_attr, None)
            if isinstance(norm, RMSNorm):
                norm.fusion = NormShrinkFusion(norm, target, backend)
                count += 1
        down, name = modules.get("down_proj"), module_names.get("down_proj", {}).get(layer_id)
        if (backend.rowwise_decode and down is not None and down.lora is not None and name
                and name.endswith(".mlp.down_proj")):
            act = getattr(model.get_submodule(name[: -len(".down_proj")]), "act_fn", None)
            if isinstance(act, SiluAndMul):
                act.fusion = ActShrinkFusion(down, backend)
                count += 1
    return count
