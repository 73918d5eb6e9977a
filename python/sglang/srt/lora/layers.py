"""LoRA wrappers around the model's fused linear layers.

They replace the modules after the model is built (models/ never imports lora/). Each hands its
input to the backend, which returns the base output with `scaling * (x @ A^T) @ B^T` of every
token's adapter slot added: for a folded module in ONE GEMM over [x | shrink] and the augmented
weight W_aug (lora/fold.py), otherwise the base layer's GEMM plus a shrink and an expand. The
pool's views (`LoRAModuleWeights`) are set once (`set_lora_info`) and never change.

Graph pitfall: the LoRA path runs whenever the backend has batch info, never skipped because "no
request of this batch has an adapter". Graphs are captured with all-base batches; a skip there
would record a graph without the kernels, and adapter requests replaying it would silently lose
their deltas. The kernels add nothing for rank-0 slots. (A batch that should run no LoRA kernels at
all clears the backend's batch info: then every wrapper is its base layer, reading the base weight
`W_aug[:, :K]` of a folded module at the same cost.)

Tensor parallelism (DESIGN §11): the pool holds this rank's part of every adapter (lora.py). A
column-parallel wrapper adds its delta into its slice of the output (A whole, B's rows of that
slice). A row-parallel wrapper hands the backend the base layer's *partial* product (its input
slice, the bias on rank 0 only) with A's columns of that slice and B whole, and all-reduces the
sum: folded, that is [x_shard | partial shrink] @ [W_shard | B]^T, then the all-reduce.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import nn

from sglang.srt.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from sglang.srt.lora.backend.base_backend import BaseLoRABackend
from sglang.srt.lora.utils import DeferredDelta, DeferredExpand, LoRAModuleWeights, PreparedInput


class BaseLayerWithLoRA(nn.Module):
    def __init__(self, base_layer: nn.Module, lora_backend: BaseLoRABackend) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.lora_backend = lora_backend
        self.lora: Optional[LoRAModuleWeights] = None
        # What the norm before this module already wrote (lora/norm_fusion.py), for the next call.
        self.prepared: Optional[PreparedInput] = None
        # A-fold (o_proj, down_proj): whether a fused norm after this module takes its delta (set by
        # lora/norm_fusion.py). What this module left in this forward for the kernel after it (that
        # norm's delta, or gate_up_proj's expand for the SiLU-and-mul) with the base output it belongs
        # to, until that kernel takes it.
        self.defers_to_norm = False
        self.deferred: Optional[tuple[Union[DeferredDelta, DeferredExpand], torch.Tensor]] = None

    # The rest of the engine may read the wrapped layer's attributes through the wrapper.
    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    @property
    def bias(self) -> Optional[torch.Tensor]:
        return self.base_layer.bias

    @property
    def input_size(self) -> int:
        return self.base_layer.input_size

    @property
    def output_size(self) -> int:
        return self.base_layer.output_size

    @property
    def backend_bias(self) -> Optional[torch.Tensor]:
        """The bias the backend's module call adds (a folded GEMM adds it itself)."""
        return self.base_layer.bias

    def set_lora_info(self, weights: LoRAModuleWeights) -> None:
        """This layer's views of the pool (fixed addresses) and, when folded, its W_aug."""
        self.lora = weights

    @property
    def A_buffer(self) -> Optional[torch.Tensor]:
        return None if self.lora is None else self.lora.A

    @property
    def B_buffer(self) -> Any:
        return None if self.lora is None else self.lora.B

    @property
    def lora_active(self) -> bool:
        # batch_info is None before the first fill_batch_info (e.g. a memory-profiling forward)
        # and for batches that run without LoRA; it never depends on which adapters a batch uses.
        return self.lora is not None and self.lora_backend.batch_info is not None

    def take_prepared(self, x: torch.Tensor) -> Optional[PreparedInput]:
        """What the kernel before this module wrote for it, if `x` is its output (same address and
        shape): that kernel already computed this module's shrink. Cleared either way."""
        prepared, self.prepared = self.prepared, None
        if prepared is not None and x.data_ptr() == prepared.normed.data_ptr() and x.shape == prepared.normed.shape:
            return prepared
        return None

    def take_deferred(self, x: torch.Tensor) -> Optional[Union[DeferredDelta, DeferredExpand]]:
        """What this module left for the kernel after it, which is called with `x`: it must be the
        base output that belongs to (a delta must never be dropped). Cleared."""
        deferred, self.deferred = self.deferred, None
        if deferred is None:
            return None
        delta, out = deferred
        assert x.data_ptr() == out.data_ptr() and x.shape == out.shape, "the next kernel is not fed this module's output"
        return delta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        prepared = self.take_prepared(x)
        if not self.lora_active:
            return self.base_layer(x)
        if prepared is not None:
            return self.lora_backend.run_prepared(self.lora, prepared, self.base_layer)
        out = self.lora_backend.run_module(self.lora, self.base_layer, x.reshape(-1, x.shape[-1]))
        return out.view(*x.shape[:-1], out.shape[-1])

    def extra_repr(self) -> str:
        folded = self.lora is not None and self.lora.folded is not None
        return f"lora_set={self.lora is not None}, folded={folded}"


class ColumnParallelLinearWithLoRA(BaseLayerWithLoRA):
    """One output slice; under TP this rank's rows of it (the output stays sharded)."""


class QKVParallelLinearWithLoRA(ColumnParallelLinearWithLoRA):
    """q, k, v: three output slices (widths from the manager's shapes)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora_active and self.lora_backend.expands_a_folded(self.lora):
            # Prefills with SGLANG_LORA_AFOLD_QKV: the GEMM over [W; A] and the expand; the output is
            # a strided view of the GEMM's, which the RoPE kernel reads in place. The norm before
            # wrote plain rows (in_place_input declines), so nothing was prepared.
            prepared = self.take_prepared(x)
            assert prepared is None, "the norm before an A-folded qkv_proj wrote into x_aug"
            out = self.lora_backend.run_a_folded(self.lora, x.reshape(-1, x.shape[-1]))
            return out.view(*x.shape[:-1], out.shape[-1])
        return super().forward(x)


class MergedColumnParallelLinearWithLoRA(ColumnParallelLinearWithLoRA):
    """gate, up: two output slices."""

    def __init__(self, base_layer: nn.Module, lora_backend: BaseLoRABackend) -> None:
        super().__init__(base_layer, lora_backend)
        # Whether the SiLU-and-mul after this module takes its expand (set by lora/norm_fusion.py
        # with the backend's expand_silu); what it leaves goes to `deferred`.
        self.defers_to_act = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.deferred = None  # a forward cut short may have left one: its output is gone too
        if self.defers_to_act and self.lora_active and self.lora_backend.defers_expand(self.lora):
            prepared = self.take_prepared(x)
            out, xa = self.lora_backend.run_without_expand(self.lora, self.base_layer, x.reshape(-1, x.shape[-1]),
                                                           prepared)
            out = out.view(*x.shape[:-1], out.shape[-1])
            self.deferred = (DeferredExpand(xa), out)
            return out
        return super().forward(x)


class RowParallelLinearWithLoRA(BaseLayerWithLoRA):
    """o_proj / down_proj: base partial product plus this rank's partial delta, then the all-reduce
    (at tp 1 the partial product is the whole output and the reduction the identity)."""

    @property
    def backend_bias(self) -> Optional[torch.Tensor]:
        return self.base_layer.partial_bias  # rank 0's alone: the all-reduce must count it once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        prepared = self.take_prepared(x)
        if not self.lora_active:
            return self.base_layer(x)
        base = self.base_layer
        self.deferred = None  # a forward cut short (an exception) may have left one: its output is gone too
        if self.defers_to_norm and self.lora_backend.defers(self.lora):
            # A-fold (tp 1 only: the pool lays it out for one rank): base output and every slot's
            # shrink in one GEMM; the fused norm after this module adds the row's delta.
            assert prepared is None
            out, delta = self.lora_backend.run_deferred(self.lora, x.reshape(-1, x.shape[-1]))
            self.deferred = (delta, out)
            return out.view(*x.shape[:-1], out.shape[-1])
        if self.defers_to_norm and prepared is None and self.lora_backend.expands_a_folded(self.lora):
            # Larger decode batches (SGLANG_LORA_AFOLD_EXPAND): the same GEMM, then the expand; the
            # output is a strided view of the GEMM's, which the fused norm after this module reads.
            out = self.lora_backend.run_a_folded(self.lora, x.reshape(-1, x.shape[-1]))
            return out.view(*x.shape[:-1], out.shape[-1])
        if prepared is not None:  # down_proj after the fused SiLU-and-mul (lora/norm_fusion.py)
            partial = self.lora_backend.run_prepared(self.lora, prepared, base.forward_partial)
        else:
            partial = self.lora_backend.run_module(self.lora, base.forward_partial, x.reshape(-1, x.shape[-1]))
        return base.reduce(partial).view(*x.shape[:-1], partial.shape[-1])


def get_lora_layer(layer: nn.Module, lora_backend: BaseLoRABackend) -> BaseLayerWithLoRA:
    """The wrapper for a base linear layer (most specific class first)."""
    for base_cls, wrapper in (
        (QKVParallelLinear, QKVParallelLinearWithLoRA),
        (MergedColumnParallelLinear, MergedColumnParallelLinearWithLoRA),
        (RowParallelLinear, RowParallelLinearWithLoRA),
        (ColumnParallelLinear, ColumnParallelLinearWithLoRA),
    ):
        if isinstance(layer, base_cls):
            return wrapper(layer, lora_backend)
    raise ValueError(f"No LoRA wrapper for {type(layer).__name__}")
