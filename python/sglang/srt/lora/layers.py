"""LoRA wrappers around the model's fused linear layers.

They replace the modules after the model is built (models/ never imports lora/). Each computes the
base output, then lets the backend add `scaling * (x @ A^T) @ B^T` of every token's adapter slot
into it in place. The A/B views come from the memory pool once (`set_lora_info`) and never change.

Graph pitfall: the LoRA kernels run whenever LoRA info is set, never skipped because "no request
of this batch has an adapter". Graphs are captured with all-base batches; a skip there would record
a graph without the kernels, and adapter requests replaying it would silently lose their deltas.
The kernels are no-ops for rank-0 slots, so the base path costs only their launches.

Tensor parallelism (DESIGN §11): the pool holds this rank's part of every adapter (lora.py). A
column-parallel wrapper adds its delta into its slice of the output (A whole, B's rows of that
slice); a row-parallel wrapper adds the delta of its input slice (A's columns of it, B whole) into
the base layer's partial output before the all-reduce, which then sums base and delta alike.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from sglang.srt.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from sglang.srt.lora.backend.base_backend import BaseLoRABackend


class BaseLayerWithLoRA(nn.Module):
    def __init__(self, base_layer: nn.Module, lora_backend: BaseLoRABackend) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.lora_backend = lora_backend
        self.A_buffer: Optional[torch.Tensor] = None
        self.B_buffer: Optional[torch.Tensor] = None

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

    def set_lora_info(self, A_buffer: torch.Tensor, B_buffer: torch.Tensor) -> None:
        """A [slots, c*R, in], B [slots, out, R]: this layer's views of the pool (fixed addresses)."""
        self.A_buffer = A_buffer
        self.B_buffer = B_buffer

    @property
    def lora_active(self) -> bool:
        # batch_info is None only before the first prepare_lora_batch (e.g. a memory-profiling
        # forward); it never depends on which adapters the batch uses.
        return self.A_buffer is not None and self.lora_backend.batch_info is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base_out = self.base_layer(x)
        if self.lora_active:
            x2 = x.reshape(-1, x.shape[-1])
            out2 = base_out.view(-1, base_out.shape[-1])  # a view: in-place adds reach base_out
            self.apply_lora(out2, x2)
        return base_out

    def apply_lora(self, base_out: torch.Tensor, x: torch.Tensor) -> None:
        """One output slice: shrink, then expand added in place into base_out. The fused qkv and
        gate_up wrappers override this with their multi-slice kernels."""
        shrunk = self.lora_backend.run_lora_a_sgemm(x, self.A_buffer, 1)
        self.lora_backend.run_lora_b_sgemm(shrunk, self.B_buffer, base_out)

    def extra_repr(self) -> str:
        return f"lora_set={self.A_buffer is not None}"


class ColumnParallelLinearWithLoRA(BaseLayerWithLoRA):
    """One output slice; under TP this rank's rows of it (the output stays sharded)."""


class QKVParallelLinearWithLoRA(ColumnParallelLinearWithLoRA):
    def __init__(self, base_layer: QKVParallelLinear, lora_backend: BaseLoRABackend) -> None:
        super().__init__(base_layer, lora_backend)
        q, kv = base_layer.q_proj_shard_size, base_layer.kv_proj_shard_size
        # Created once: a CUDA graph records this tensor's address.
        self.output_offset = torch.tensor(
            [0, q, q + kv, q + 2 * kv], dtype=torch.int32, device=base_layer.weight.device
        )
        self.max_qkv_out_dim = max(q, kv)

    def apply_lora(self, base_out: torch.Tensor, x: torch.Tensor) -> None:
        self.lora_backend.run_qkv_lora(
            x, self.A_buffer, self.B_buffer, self.output_offset, self.max_qkv_out_dim, base_out
        )


class MergedColumnParallelLinearWithLoRA(ColumnParallelLinearWithLoRA):
    def __init__(self, base_layer: MergedColumnParallelLinear, lora_backend: BaseLoRABackend) -> None:
        super().__init__(base_layer, lora_backend)
        sizes = list(base_layer.output_sizes)
        # The gate_up kernels split B's output rows into two equal halves.
        if len(sizes) != 2 or sizes[0] != sizes[1]:
            raise ValueError(f"gate_up_proj LoRA needs two equal output halves, got {sizes}")

    def apply_lora(self, base_out: torch.Tensor, x: torch.Tensor) -> None:
        self.lora_backend.run_gate_up_lora(x, self.A_buffer, self.B_buffer, base_out)


class RowParallelLinearWithLoRA(BaseLayerWithLoRA):
    """o_proj / down_proj: the delta joins the partial output before the all-reduce (identity at
    tp 1, where this is the base output followed by shrink/expand, as before)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.base_layer.forward_partial(x)
        if self.lora_active:
            self.apply_lora(partial.view(-1, partial.shape[-1]), x.reshape(-1, x.shape[-1]))
        return self.base_layer.reduce(partial)


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
