"""The LoRA backend interface: kernels that apply adapters, and the batch metadata they read.

Weights (owned by the memory pool, never reallocated):
  A: [num_slots, c * R, in_dim]   shrink weights, c = 3 (qkv), 2 (gate_up), 1 (others)
  B: [num_slots, out_dim, R]      expand weights
An adapter of rank r <= R occupies the compact prefix of its slot: slice k of A is rows
[k*r, (k+1)*r), B uses columns [0, r).

Kernel semantics, for each token row t in a segment using slot s with rank r = lora_ranks[s] > 0:
  shrink:  out[t, :c*r] = x[t] @ A[s, :c*r].T                 (no scaling; columns >= c*r untouched)
  expand:  base_output[t, off_k:off_k+1] += scalings[s] * out[t, k*r:(k+1)*r] @ B[s, off_k:off_k+1, :r].T
Rows of segments whose slot has rank 0, rows of zero-length segments and rows outside every
segment are not touched at all, so base requests and padded tokens cost only the launch.

Metadata (`LoRABatchInfo`, lora/utils.py) is prepared by `prepare_lora_batch` before each forward,
in one of three places, chosen by the caller (ModelRunner decides once per forward):
  use_cuda_graph=True           the decode graph's static info, refreshed in place
  use_prefill_cuda_graph=True   the prefill graph's static info, refreshed in place
  neither                       a fresh info for this eager forward
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from sglang.srt.lora.utils import LoRABatchInfo

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch


class BaseLoRABackend:
    name: str = "base"
    # Whether this backend can serve the prefill CUDA graph from static, in-place metadata.
    supports_prefill_cuda_graph: bool = False
    # MoE LoRA is not supported by this engine; kept for the eligibility predicate.
    is_moe_lora: bool = False

    def __init__(
        self,
        max_loras_per_batch: int,
        device: torch.device | str,
        max_lora_chunk_size: int = 16,
    ) -> None:
        self.max_loras_per_batch = max_loras_per_batch
        self.device = torch.device(device)
        self.max_lora_chunk_size = max_lora_chunk_size
        # The info the kernels read in the current forward (one of the three below).
        self.batch_info: Optional[LoRABatchInfo] = None
        # Decode graph static info (init_cuda_graph_batch_info).
        self.cuda_graph_batch_info: Optional[LoRABatchInfo] = None
        self.max_bs_in_cuda_graph: Optional[int] = None
        # Prefill graph static info and the request/token caps it can serve (None = not initialised).
        self.prefill_cuda_graph_batch_info: Optional[LoRABatchInfo] = None
        self.prefill_cuda_graph_max_bs: Optional[int] = None
        self.prefill_cuda_graph_max_tokens: Optional[int] = None

    # ---- kernels ---------------------------------------------------------------------------
    def run_lora_a_sgemm(self, x: torch.Tensor, weights: torch.Tensor, stack_num: int = 1) -> torch.Tensor:
        """Shrink: x [T, in] -> [T, stack_num * R]."""
        raise NotImplementedError

    def run_lora_b_sgemm(
        self, x: torch.Tensor, weights: torch.Tensor, base_output: torch.Tensor
    ) -> torch.Tensor:
        """Expand one slice: base_output [T, out] += scale * x[:, :r] @ B[:, :r].T. Returns base_output."""
        raise NotImplementedError

    def run_qkv_lora(
        self,
        x: torch.Tensor,
        qkv_lora_a: torch.Tensor,
        qkv_lora_b: torch.Tensor,
        output_offset: torch.Tensor,
        max_qkv_out_dim: int,
        base_output: torch.Tensor,
    ) -> torch.Tensor:
        """Shrink with A [slots, 3R, in] then expand the q, k, v slices into base_output [T, q+2kv].

        `output_offset` is an int32 device tensor [0, q, q+kv, q+2kv]; `max_qkv_out_dim` = max(q, kv).
        """
        raise NotImplementedError

    def run_gate_up_lora(
        self,
        x: torch.Tensor,
        gate_up_lora_a: torch.Tensor,
        gate_up_lora_b: torch.Tensor,
        base_output: torch.Tensor,
    ) -> torch.Tensor:
        """Shrink with A [slots, 2R, in] then expand the gate and up halves into base_output [T, 2I]."""
        raise NotImplementedError

    # ---- metadata --------------------------------------------------------------------------
    def init_cuda_graph_batch_info(self, max_bs_in_cuda_graph: int, num_tokens_per_bs: int = 1) -> None:
        """Allocate the decode graph's static info once (before capture)."""
        raise NotImplementedError(f"LoRA backend {self.name} does not support the decode CUDA graph.")

    def init_prefill_cuda_graph_batch_info(self, max_num_tokens: int) -> None:
        """Allocate the prefill graph's static info once, sized for the largest token bucket."""
        raise NotImplementedError(f"LoRA backend {self.name} does not support the prefill CUDA graph.")

    def prepare_lora_batch(
        self,
        forward_batch: "ForwardBatch",
        weight_indices: list[int],
        lora_ranks: list[int],
        scalings: list[float],
        use_cuda_graph: bool,
        use_prefill_cuda_graph: bool = False,
    ) -> None:
        """Fill `self.batch_info` for this forward.

        weight_indices: pool slot per request (length batch_size);
        lora_ranks, scalings: per slot (length max_loras_per_batch), rank 0 for empty/base slots.
        """
        raise NotImplementedError
