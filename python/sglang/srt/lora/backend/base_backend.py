"""The LoRA backend interface: how a wrapped module computes base output plus LoRA, and the batch
metadata its kernels read.

Weights (owned by the memory pool, never reallocated; `LoRAModuleWeights`, lora/utils.py):
  A: [num_slots, c * R, in_dim]   shrink weights, c = 3 (qkv), 2 (gate_up), 1 (others)
  B: [num_slots, out_dim, R]      expand weights (inside W_aug for folded modules, lora/fold.py)
An adapter of rank r <= R occupies the compact prefix of its slot: slice k of A is rows
[k*r, (k+1)*r), B uses columns [0, r).

`run_module(weights, base_layer, x)` returns, for every token row t whose slot s has rank r > 0,
  base_layer(x)[t] + scalings[s] * (x[t] @ A[s, k*r:(k+1)*r].T) @ B[s, slice k, :r].T  (per slice k)
and base_layer(x)[t] for every other row (base requests, rank-0 slots, padding). How is the
backend's: folded modules run one GEMM over [x | shrink] and W_aug, others add a shrink/expand.
`base_layer` is only called: a row-parallel wrapper under tensor parallelism passes the layer's
partial product (`forward_partial`) and all-reduces the result itself.

Metadata (`LoRABatchInfo`, lora/utils.py) is written by `fill_batch_info` before each forward,
in the place the forward's path reads it (ModelRunner decides the path once per forward and the
manager hands the same `ForwardPath` on):
  DECODE_GRAPH    the decode graph's static info, refreshed in place
  PREFILL_GRAPH   the prefill graph's static info, refreshed in place
  EAGER           a fresh info for this eager forward
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Optional, Sequence

import torch
from torch import nn

from sglang.srt.configs.forward_path import ForwardPath
from sglang.srt.lora.utils import DeferredDelta, LoRABatchInfo, LoRAModuleSpec, LoRAModuleWeights, PreparedInput

if TYPE_CHECKING:
    from sglang.srt.configs.forward_batch_info import ForwardBatch


class BaseLoRABackend(abc.ABC):
    """A backend implements `run_module` (the wrapped layers' call) and `fill_batch_info` (the
    metadata of one forward); one that serves CUDA graphs also allocates their static infos
    (`init_cuda_graph_batch_info`, `init_prefill_cuda_graph_batch_info`) and says so with
    `supports_prefill_cuda_graph`."""

    name: str  # the --lora-backend value
    # Whether its metadata can live in static buffers refreshed in place, which both graphs with
    # LoRA kernels need (SGLang's name says prefill: that is the graph it was added for); a backend
    # without (host-side metadata) runs adapter batches eagerly.
    supports_prefill_cuda_graph: bool = False
    # Whether modules may be folded into their base GEMM (W_aug, lora/fold.py).
    supports_fold: bool = False
    # Whether the norm before a folded module can run inside its shrink_pack at decode
    # (--lora-fuse-norm, lora/norm_fusion.py).
    supports_norm_fusion: bool = False
    # With it, whether the kernels before o_proj / down_proj go row-wise too (token_backend.py),
    # at some decode batches; `rowwise_now` says whether in the batch being run.
    rowwise_decode: bool = False
    # Graph-path metadata refreshes, and those that had to write (the batch differed from the last
    # one written); /get_server_info reports them.
    metadata_refreshes: int = 0
    metadata_writes: int = 0

    def rowwise_now(self) -> bool:
        return False

    def __init__(
        self,
        max_loras_per_batch: int,
        device: torch.device | str,
        max_lora_chunk_size: int = 16,
    ) -> None:
        self.max_loras_per_batch = max_loras_per_batch
        self.device = torch.device(device)
        self.max_lora_chunk_size = max_lora_chunk_size
        self.specs: dict[str, LoRAModuleSpec] = {}
        # The info the kernels read in the current forward (one of the three below).
        self.batch_info: Optional[LoRABatchInfo] = None
        # Decode graph static info (init_cuda_graph_batch_info).
        self.cuda_graph_batch_info: Optional[LoRABatchInfo] = None
        self.max_bs_in_cuda_graph: Optional[int] = None
        # Prefill graph static info and the request/token caps it can serve (None = not initialised).
        self.prefill_cuda_graph_batch_info: Optional[LoRABatchInfo] = None
        self.prefill_cuda_graph_max_bs: Optional[int] = None
        self.prefill_cuda_graph_max_tokens: Optional[int] = None

    # ---- modules ---------------------------------------------------------------------------
    def init_modules(
        self,
        specs: dict[str, LoRAModuleSpec],
        slot_ranks: torch.Tensor,
        slot_scalings: torch.Tensor,
        dtype: torch.dtype,
    ) -> None:
        """Once, after the manager wrapped the model: every module kind, and the pool's per-slot
        rank/scaling device tensors (fixed addresses, updated by the pool on load and free)."""
        self.specs = dict(specs)

    @abc.abstractmethod
    def run_module(self, weights: LoRAModuleWeights, base_layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> base output [T, out] with every row's adapter delta added, reading the
        current `batch_info` (never None when a wrapper calls this)."""

    def fuses_norm(self) -> bool:
        """Whether this forward runs the kernels before the LoRA modules together with their shrink."""
        return False

    def run_norm(self, weights: LoRAModuleWeights, norm_weight: torch.Tensor, eps: float, x: torch.Tensor,
                 residual: Optional[torch.Tensor], delta: Optional[DeferredDelta] = None
                 ) -> tuple[PreparedInput, Optional[torch.Tensor]]:
        """(the norm of x (+ residual) with the module's shrink, the new residual); with `delta`, x is
        an A-folded module's base output and its delta is added first."""
        raise NotImplementedError(f"LoRA backend {self.name} does not fuse norms")

    # An A-folded module (lora/fold.py a_fold_views) may leave its delta to the fused norm after it.
    a_fold: bool = False
    # qkv_proj takes the A-fold's layout for its prefills (csgmv, SGLANG_LORA_AFOLD_QKV;
    # fold.A_FOLD_PREFILL_MODULES).
    a_fold_prefill: bool = False

    def defers(self, weights: LoRAModuleWeights) -> bool:
        """Whether this forward's A-folded `weights` leave their delta to the norm after them."""
        return False

    def run_deferred(self, weights: LoRAModuleWeights, x: torch.Tensor) -> tuple[torch.Tensor, DeferredDelta]:
        """(the module's base output, its delta for the norm after it): one GEMM over [W; A]."""
        raise NotImplementedError(f"LoRA backend {self.name} does not defer deltas")

    def expands_a_folded(self, weights: LoRAModuleWeights) -> bool:
        """Whether this forward runs A-folded `weights` as their GEMM over [W; A] and an expand
        (decode batches past the deferral's bound, SGLANG_LORA_AFOLD_EXPAND; prefills,
        SGLANG_LORA_AFOLD_PREFILL and, for qkv_proj, SGLANG_LORA_AFOLD_QKV)."""
        return False

    def run_a_folded(self, weights: LoRAModuleWeights, x: torch.Tensor) -> torch.Tensor:
        """The module's output (base + delta): the GEMM over [W; A], then the expand in place."""
        raise NotImplementedError(f"LoRA backend {self.name} has no A-fold expand")

    # Whether in_place_input may answer (the SiLU-and-mul before down_proj then gets a fusion too).
    pack_in_place: bool = False

    def in_place_input(self, weights: LoRAModuleWeights, rows: int) -> Optional[PreparedInput]:
        """Where the kernel before an unfused folded module (its norm, the SiLU-and-mul) may write
        its output for this forward: x_aug's first columns (`pack_pending`), so that the module's
        shrink_pack need not copy it there; None: the kernel writes its own output."""
        return None

    def run_act(self, weights: LoRAModuleWeights, gate_up: torch.Tensor) -> PreparedInput:
        """SiLU-and-mul of gate_up with the shrink of the module it feeds (down_proj)."""
        raise NotImplementedError(f"LoRA backend {self.name} does not fuse activations")

    def run_prepared(self, weights: LoRAModuleWeights, prepared: PreparedInput, base_layer: nn.Module) -> torch.Tensor:
        """The module's output (base + LoRA) from what `run_norm` wrote."""
        raise NotImplementedError(f"LoRA backend {self.name} does not fuse norms")

    # An unfolded gate_up_proj may leave its expand to the SiLU-and-mul after it (csgmv,
    # SGLANG_LORA_EXPAND_SILU; lora/triton_ops/expand_silu.py).
    expand_silu: bool = False

    def defers_expand(self, weights: LoRAModuleWeights) -> bool:
        """Whether this forward's gate_up_proj `weights` leave their expand to the activation."""
        return False

    def run_without_expand(self, weights: LoRAModuleWeights, base_layer: nn.Module, x: torch.Tensor,
                           prepared: Optional[PreparedInput]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the base output, the rows' shrink xa) of an unfolded module: everything but its expand
        (`prepared`: what a fused norm wrote, then `x` is its normalised rows)."""
        raise NotImplementedError(f"LoRA backend {self.name} does not defer expands")

    def run_expand_act(self, weights: LoRAModuleWeights, xa: torch.Tensor, gate_up: torch.Tensor,
                       out: Optional[torch.Tensor]) -> torch.Tensor:
        """SiLU-and-mul of gate_up (the base output) with gate_up_proj's delta (from xa) added first,
        into `out` when given."""
        raise NotImplementedError(f"LoRA backend {self.name} does not defer expands")

    # ---- metadata --------------------------------------------------------------------------
    def init_cuda_graph_batch_info(self, max_bs_in_cuda_graph: int, num_tokens_per_bs: int = 1,
                                   buckets: Optional[Sequence[int]] = None) -> None:
        """Allocate the decode graph's static info once (before capture); `buckets` are the decode
        graphs' batch sizes (None: every size up to the max is its own)."""
        raise NotImplementedError(f"LoRA backend {self.name} does not support the decode CUDA graph.")

    def init_prefill_cuda_graph_batch_info(self, max_num_tokens: int, buckets: Optional[Sequence[int]] = None) -> None:
        """Allocate the prefill graph's static info once, sized for the largest token bucket;
        `buckets` are the prefill graphs' token counts."""
        raise NotImplementedError(f"LoRA backend {self.name} does not support the prefill CUDA graph.")

    @staticmethod
    def _request_lens(forward_batch: "ForwardBatch") -> list[int]:
        """Tokens per request of this forward (host ints)."""
        if not forward_batch.forward_mode.is_extend():
            return [1] * forward_batch.batch_size
        if forward_batch.extend_seq_lens_cpu is not None:
            return [int(n) for n in forward_batch.extend_seq_lens_cpu]
        # Every builder in this engine sets the host copy; without it we must fetch (one sync).
        return forward_batch.extend_seq_lens.tolist()

    @abc.abstractmethod
    def fill_batch_info(
        self,
        forward_batch: "ForwardBatch",
        weight_indices: list[int],
        lora_ranks: list[int],
        scalings: list[float],
        path: ForwardPath,
    ) -> None:
        """Set `self.batch_info` for this forward, written where `path` reads it (the static
        infos of the graph paths are refreshed in place, never reallocated).

        weight_indices: pool slot per request (length batch_size);
        lora_ranks, scalings: per slot (length max_loras_per_batch), rank 0 for empty/base slots.
        """
