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
takes the unfused path, which computes the same function. With SGLANG_LORA_PACK_IN_PLACE=1 (the
default) the
unfused path before a folded module writes the norm's (or the SiLU-and-mul's) output straight into
the module's x_aug (`backend.in_place_input`), where shrink_pack would have copied it: the same
kernel and bits, one write of the rows less.

A third seam at small decode batches (SGLANG_LORA_AFOLD, backend/token_backend.py): an A-folded
o_proj or down_proj (lora/fold.py) runs only its GEMM over [W; A], which also gives every slot's
shrink, and leaves the delta (`BaseLayerWithLoRA.deferred`) to the fused norm its output feeds
(`NormShrinkFusion.producer`: post_attention_layernorm for o_proj, the next layer's input_layernorm
for down_proj). That norm adds `scaling * shrink @ B^T` to the row before the residual. The last
layer's down_proj feeds the final norm, which has no fusion, so it keeps its kernel.

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
from sglang.srt.layers.triton_ops.dispatch import use_triton
from sglang.srt.layers.triton_ops.rmsnorm import rmsnorm_fwd
from sglang.srt.layers.triton_ops.silu_and_mul import silu_and_mul_fwd
from sglang.srt.lora.layers import BaseLayerWithLoRA, MergedColumnParallelLinearWithLoRA

if TYPE_CHECKING:
    from sglang.srt.lora.backend.base_backend import BaseLoRABackend

logger = logging.getLogger(__name__)

# (norm attribute of the decoder layer, path of the module it feeds, relative to the layer).
NORM_FED_MODULES = (("input_layernorm", "self_attn.qkv_proj"), ("post_attention_layernorm", "mlp.gate_up_proj"))


class NormShrinkFusion:
    """The `fusion` of one RMSNorm whose output feeds one LoRA module. A plain object, not a
    module: it must not put the target into the norm's module tree."""

    def __init__(self, norm: RMSNorm, target: BaseLayerWithLoRA, backend: "BaseLoRABackend",
                 producer: Optional[BaseLayerWithLoRA] = None) -> None:
        # producer: the A-folded module whose output this norm takes (o_proj, the previous layer's
        # down_proj), which may leave its delta here (`defers_to_norm`).
        self.norm, self.target, self.backend, self.producer = norm, target, backend, producer

    def __call__(self, x: torch.Tensor, residual: Optional[torch.Tensor]) -> Optional[NormResult]:
        target = self.target
        delta = self.producer.take_deferred(x) if self.producer is not None else None
        if not target.lora_active or not self.backend.fuses_norm():
            # Both follow the batch info the producer's deferral did: a delta is never dropped here.
            assert delta is None, "an A-folded module left a delta to a norm that does not fuse"
            return self._into_x_aug(x, residual) if target.lora_active and self.backend.pack_in_place else None
        prepared, new_residual = self.backend.run_norm(target.lora, self.norm.weight, self.norm.variance_epsilon,
                                                       x, residual, delta=delta)
        target.prepared = prepared
        return prepared.normed if residual is None else (prepared.normed, new_residual)

    def _into_x_aug(self, x: torch.Tensor, residual: Optional[torch.Tensor]) -> Optional[NormResult]:
        """The plain norm, written where the backend asks (x_aug's first columns), or None."""
        if x.dim() != 2 or not use_triton(x):
            return None
        prepared = self.backend.in_place_input(self.target.lora, x.shape[0])
        if prepared is None:
            return None
        rmsnorm_fwd(x, self.norm.weight, self.norm.variance_epsilon, residual=residual, out=prepared.normed)
        self.target.prepared = prepared
        return prepared.normed if residual is None else (prepared.normed, residual)


class ActShrinkFusion:
    """The `fusion` of the SiLU-and-mul before down_proj: with SGLANG_LORA_ROWWISE_DECODE, the
    activation and down_proj's shrink in one kernel at decode; with SGLANG_LORA_PACK_IN_PLACE, the
    activation written into down_proj's x_aug where nothing fuses."""

    def __init__(self, target: BaseLayerWithLoRA, backend: "BaseLoRABackend",
                 producer: Optional[MergedColumnParallelLinearWithLoRA] = None) -> None:
        # producer: the gate_up_proj whose output this activation takes, which may leave its expand
        # here (`defers_to_act`, the backend's expand_silu) as a DeferredExpand.
        self.target, self.backend, self.producer = target, backend, producer

    def __call__(self, gate_up: torch.Tensor) -> Optional[torch.Tensor]:
        target = self.target
        pending = self.producer.take_deferred(gate_up) if self.producer is not None else None
        if pending is not None:
            return self._with_expand(gate_up, pending.xa)
        if not target.lora_active or gate_up.dim() != 2:
            return None
        if not self.backend.rowwise_now():
            return self._into_x_aug(gate_up) if self.backend.pack_in_place else None
        if target.defers_to_norm and self.backend.defers(target.lora):
            return None  # down_proj takes no shrink from here: its GEMM computes it (A-fold)
        target.prepared = self.backend.run_act(target.lora, gate_up)
        return target.prepared.normed

    def _with_expand(self, gate_up: torch.Tensor, xa: torch.Tensor) -> torch.Tensor:
        """gate_up_proj's delta added and the SiLU-and-mul applied in one kernel, written where the
        backend asks (down_proj's x_aug, as _into_x_aug would) or to its own tensor."""
        target, backend = self.target, self.backend
        rows = gate_up.numel() // gate_up.shape[-1]
        prepared = None
        # Into down_proj's x_aug only for 2-D rows, as _into_x_aug (the module is called with them).
        if (gate_up.dim() == 2 and target.lora_active and backend.pack_in_place
                and not (target.defers_to_norm and backend.expands_a_folded(target.lora))):
            prepared = backend.in_place_input(target.lora, rows)
        act = backend.run_expand_act(self.producer.lora, xa, gate_up.reshape(rows, gate_up.shape[-1]),
                                     None if prepared is None else prepared.normed)
        if prepared is not None:
            target.prepared = prepared
            return act
        return act.view(*gate_up.shape[:-1], act.shape[-1])

    def _into_x_aug(self, gate_up: torch.Tensor) -> Optional[torch.Tensor]:
        """The plain SiLU-and-mul, written where the backend asks (x_aug's first columns), or None."""
        if not use_triton(gate_up):
            return None
        if self.target.defers_to_norm and self.backend.expands_a_folded(self.target.lora):
            return None  # down_proj's GEMM over [W; A] computes its shrink: no x_aug this time
        prepared = self.backend.in_place_input(self.target.lora, gate_up.shape[0])
        if prepared is None:
            return None
        silu_and_mul_fwd(gate_up, out=prepared.normed)
        self.target.prepared = prepared
        return prepared.normed


# The A-folded module whose output a norm takes: (norm attribute, the producer's path, its layer offset).
_PRODUCERS = {"post_attention_layernorm": ("self_attn.o_proj", 0), "input_layernorm": ("mlp.down_proj", -1)}


def _producer(wrapped: dict[int, dict[str, BaseLayerWithLoRA]], module_names: dict[str, dict[int, str]],
              layer_id: int, layer_name: str, norm_attr: str) -> Optional[BaseLayerWithLoRA]:
    """The A-folded o_proj (same layer) or down_proj (the layer before) whose output feeds the norm
    `norm_attr` of decoder layer `layer_name` (`<stack>.<layer_id>`), if it has the A-fold's weights;
    else None."""
    path, offset = _PRODUCERS[norm_attr]
    kind = path.rsplit(".", 1)[1]
    src = layer_id + offset
    module, name = wrapped.get(src, {}).get(kind), module_names.get(kind, {}).get(src)
    if module is None or name is None or module.lora is None or module.lora.a_folded is None:
        return None
    # Both in one stack of decoder layers, `<stack>.<src>` and `<stack>.<layer_id>` (the model's loop
    # hands a layer's output straight to the next one's input_layernorm).
    stack, _, index = layer_name.rpartition(".")
    if index != str(layer_id) or name != f"{stack}.{src}.{path}":
        return None
    return module


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
                producer = _producer(wrapped, module_names, layer_id, name[: -len(path) - 1], norm_attr)
                norm.fusion = NormShrinkFusion(norm, target, backend, producer)
                if producer is not None:
                    producer.defers_to_norm = True
                count += 1
        down, name = modules.get("down_proj"), module_names.get("down_proj", {}).get(layer_id)
        if ((backend.rowwise_decode or backend.pack_in_place or backend.expand_silu) and down is not None
                and down.lora is not None and name and name.endswith(".mlp.down_proj")):
            mlp = name[: -len(".down_proj")]
            act = getattr(model.get_submodule(mlp), "act_fn", None)
            if isinstance(act, SiluAndMul):
                gate_up = modules.get("gate_up_proj")
                producer = None
                if (backend.expand_silu and isinstance(gate_up, MergedColumnParallelLinearWithLoRA)
                        and gate_up.lora is not None
                        and module_names.get("gate_up_proj", {}).get(layer_id) == f"{mlp}.gate_up_proj"):
                    producer = gate_up
                    gate_up.defers_to_act = True
                act.fusion = ActShrinkFusion(down, backend, producer)
                count += 1
    return count
