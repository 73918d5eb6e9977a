"""The token-major LoRA backend (`triton`, and `csgmv` for its folded modules): every token row
names its adapter slot, and each wrapped module costs one LoRA kernel.

Per module kind (qkv_proj, o_proj, gate_up_proj, down_proj), decided once at start-up
(LoRAMemoryPool, lora/fold.py; logged by the manager):
  folded    one `shrink_pack` kernel writes x_aug = [x | each row's pre-scaled shrink in its own
            slot's block], then ONE cuBLAS GEMM `F.linear(x_aug, W_aug, bias)` gives base output
            plus LoRA delta. No expand kernel, no read-modify-write of the output.
  unfolded  the base GEMM, then a token-major shrink and expand (triton_ops/token_*.py) added in
            place; subclasses may bring their own kernels (csgmv: chunked SGMV).

Metadata, built once per batch in `prepare_lora_batch` (the caller picks the destination):
  `token_slots` int32 per row (-1 past the live rows): eager, one pinned host->device copy of a
  fresh tensor; decode and prefill graphs, a static buffer rewritten in place (one copy). Ranks
  and scalings are the pool's device tensors (`init_modules`), updated only when a slot changes.
  Grids depend on the row count only, so one graph captured for a bucket serves any number of
  requests within its rows: the prefill graph's request cap is its token count.

Launches and buffers: per batch and module kind, the launches are prepared once (`PreparedLaunch`:
grid and ints fixed, kernels bound), cached by row count; layers only pass their tensors. x_aug /
shrink outputs, split-K partials and ticket counters live in a `_Scratch`: one per graph kind,
allocated with its static info before any capture and never reallocated; eager batches borrow the
prefill (or decode) graph's when they fit, else an eager one grown in prepare. Nothing is
allocated and nothing synchronises per LoRA call. Plans depend on static shapes only
(token_lora.py), so a padded graph replay and an eager pass compute every row bit for bit alike.

Triton compiles on first launch: the graph runners' warm-up runs (capture_graph) launch every
kernel on the capture stream before capture begins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F

from sglang.srt.lora.backend._staging import copy_into, to_device
from sglang.srt.lora.backend.base_backend import BaseLoRABackend
from sglang.srt.lora.triton_ops.launch import PreparedLaunch
from sglang.srt.lora.triton_ops.token_lora import (
    pdl_available,
    plan_expand,
    plan_pack,
    plan_shrink,
    prepare_expand,
    prepare_pack,
    prepare_shrink,
)
from sglang.srt.lora.utils import LoRABatchInfo, LoRAModuleSpec, LoRAModuleWeights

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

_LAUNCH_CACHE_SIZE = 512  # distinct row counts kept (decode sizes, prefill buckets, live eager sizes)
# Programmatic dependent launch where the GPU has it (Hopper+): shrink_pack may start while the
# kernel before it drains (it waits before reading x), the unfolded expand while its shrink runs.
# The first H200 run measured tok+pdl ~15% faster than tok; set False to launch everything plainly.
USE_PDL_BY_DEFAULT = True


@dataclass
class _Scratch:
    """Per-call buffers for batches of up to `rows` rows (shared by every layer and module kind:
    each module's kernels finish with them before the next module's start, in stream order)."""

    rows: int
    flat: torch.Tensor  # x_aug of a folded module / shrink output of an unfolded one, row-major
    workspace: torch.Tensor  # fp32 split-K partials
    counters: torch.Tensor  # int32 tickets; zero between launches (each launch re-arms its own)

    def matrix(self, rows: int, width: int) -> torch.Tensor:
        return self.flat[: rows * width].view(rows, width)


@dataclass
class _ModuleLaunches:
    pack: Optional[PreparedLaunch] = None  # folded
    shrink: Optional[PreparedLaunch] = None  # unfolded, token-major
    expand: Optional[PreparedLaunch] = None


class TokenLoRABackend(BaseLoRABackend):
    name = "token"
    supports_prefill_cuda_graph = True
    supports_fold = True

    def __init__(
        self,
        max_loras_per_batch: int,
        device: torch.device | str,
        max_lora_chunk_size: int = 16,
        use_pdl: Optional[bool] = None,
    ) -> None:
        super().__init__(max_loras_per_batch, device, max_lora_chunk_size)
        # Hopper programmatic dependent launch: shrink_pack may start while its predecessor drains.
        if use_pdl is None:
            use_pdl = USE_PDL_BY_DEFAULT and pdl_available(self.device)
        self.use_pdl = use_pdl
        self.dtype: Optional[torch.dtype] = None
        self._slot_ranks: Optional[torch.Tensor] = None
        self._slot_scalings: Optional[torch.Tensor] = None
        self._slice_offsets: dict[str, torch.Tensor] = {}  # unequal slices (qkv), for the expand
        self._decode_slots: Optional[torch.Tensor] = None  # static token_slots of the decode graph
        self._prefill_slots: Optional[torch.Tensor] = None
        self._decode_scratch: Optional[_Scratch] = None
        self._prefill_scratch: Optional[_Scratch] = None
        self._eager_scratch: Optional[_Scratch] = None
        self._scratch: Optional[_Scratch] = None  # the current batch's
        self._launch_cache: dict[int, dict[str, _ModuleLaunches]] = {}
        self._layouts: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._launches: dict[str, _ModuleLaunches] = {}

    # ---- start-up ----------------------------------------------------------------------------
    def init_modules(
        self,
        specs: dict[str, LoRAModuleSpec],
        slot_ranks: torch.Tensor,
        slot_scalings: torch.Tensor,
        dtype: torch.dtype,
    ) -> None:
        """The wrapped module kinds and the pool's per-slot device tensors (fixed addresses)."""
        assert not self.specs, "init_modules runs once"
        self.specs = dict(specs)
        self._slot_ranks, self._slot_scalings, self.dtype = slot_ranks, slot_scalings, dtype
        for name, spec in self.specs.items():
            if not spec.folded and not spec.equal_slices:
                self._slice_offsets[name] = torch.tensor(spec.slice_offsets, dtype=torch.int32, device=self.device)
        self._layouts = self._layout_tensors()

    def _scratch_for(self, rows: int) -> _Scratch:
        width = max((s.in_dim + s.extra_cols if s.folded else s.stack * s.max_rank) for s in self.specs.values())
        workspace = counters = 1
        elem = self.dtype.itemsize
        for s in self.specs.values():
            if s.folded or self._uses_token_kernels(s):
                plan = plan_shrink(s.in_dim, s.stack * s.max_rank, elem)
                workspace = max(workspace, plan.workspace_numel(rows))
                counters = max(counters, plan.num_counters(rows))
        dev = self.device
        return _Scratch(
            rows,
            torch.empty(rows * width, dtype=self.dtype, device=dev),
            torch.empty(workspace, dtype=torch.float32, device=dev),
            torch.zeros(counters, dtype=torch.int32, device=dev),
        )

    def _uses_token_kernels(self, spec: LoRAModuleSpec) -> bool:
        """Whether an unfolded module runs the token-major shrink/expand (subclasses may not)."""
        return True

    # ---- static infos ------------------------------------------------------------------------
    def init_cuda_graph_batch_info(self, max_bs_in_cuda_graph: int, num_tokens_per_bs: int = 1) -> None:
        rows = max_bs_in_cuda_graph * num_tokens_per_bs
        self._decode_slots = torch.full((rows,), -1, dtype=torch.int32, device=self.device)
        self._decode_scratch = self._scratch_for(rows)
        self.cuda_graph_batch_info = LoRABatchInfo(
            rows, self._decode_slots, self._slot_ranks, self._slot_scalings, use_cuda_graph=True
        )
        self.max_bs_in_cuda_graph = max_bs_in_cuda_graph

    def init_prefill_cuda_graph_batch_info(self, max_num_tokens: int) -> None:
        self._prefill_slots = torch.full((max_num_tokens,), -1, dtype=torch.int32, device=self.device)
        self._prefill_scratch = self._scratch_for(max_num_tokens)
        self.prefill_cuda_graph_batch_info = LoRABatchInfo(
            max_num_tokens, self._prefill_slots, self._slot_ranks, self._slot_scalings, use_cuda_graph=True
        )
        # Token-major metadata has no per-request part: every request has >= 1 token, so the
        # bucket's token count is also its request cap.
        self.prefill_cuda_graph_max_bs = max_num_tokens
        self.prefill_cuda_graph_max_tokens = max_num_tokens

    # ---- per-forward metadata ----------------------------------------------------------------
    def prepare_lora_batch(
        self,
        forward_batch: "ForwardBatch",
        weight_indices: list[int],
        lora_ranks: list[int],
        scalings: list[float],
        use_cuda_graph: bool,
        use_prefill_cuda_graph: bool = False,
    ) -> None:
        """Fill `self.batch_info`: the rows' slots, where the chosen path reads them, and the
        launches of every module kind for this row count. `lora_ranks` (host list) is read only by
        subclasses' segment metadata; `scalings` not at all: the kernels read the pool's device tensors."""
        assert self.specs, "init_modules must run before the first batch"
        bs = forward_batch.batch_size
        assert len(weight_indices) == bs, (len(weight_indices), bs)
        num_rows = forward_batch.num_tokens
        lens = self._request_lens(forward_batch)
        per_row = torch.repeat_interleave(torch.tensor(weight_indices, dtype=torch.int32), torch.tensor(lens))
        live = per_row.numel()
        assert live <= num_rows, (live, num_rows)
        if use_cuda_graph or use_prefill_cuda_graph:
            if use_cuda_graph:
                static, scratch, info = self._decode_slots, self._decode_scratch, self.cuda_graph_batch_info
                assert static is not None, "init_cuda_graph_batch_info must run before a decode graph batch"
            else:
                static, scratch, info = self._prefill_slots, self._prefill_scratch, self.prefill_cuda_graph_batch_info
                assert static is not None, "init_prefill_cuda_graph_batch_info must run before a prefill graph batch"
                assert forward_batch.forward_mode.is_extend(), forward_batch.forward_mode
            assert num_rows <= static.numel(), (num_rows, static.numel())
            host = torch.full((static.numel(),), -1, dtype=torch.int32)
            host[:live] = per_row
            copy_into(static, host)  # rows past the live ones: -1, never a stale slot
            info.num_rows = num_rows
        else:
            host = torch.full((num_rows,), -1, dtype=torch.int32)
            host[:live] = per_row
            scratch = self._eager_scratch_for(num_rows)
            info = LoRABatchInfo(num_rows, to_device(host, torch.int32, self.device), self._slot_ranks,
                                 self._slot_scalings)
        self._scratch = scratch
        self._launches = self._launches_for(num_rows)
        self._prepare_segments(info, lens, weight_indices, lora_ranks, use_cuda_graph or use_prefill_cuda_graph)
        self.batch_info = info

    def _prepare_segments(self, info, lens, weight_indices, lora_ranks, static) -> None:
        """Subclass hook: extra metadata for unfolded modules' own kernels (csgmv)."""

    def _eager_scratch_for(self, rows: int) -> _Scratch:
        for scratch in (self._prefill_scratch, self._decode_scratch, self._eager_scratch):
            if scratch is not None and scratch.rows >= rows:
                return scratch
        # Grown to the next power of two, so a run of growing prefills reallocates rarely.
        self._eager_scratch = self._scratch_for(1 << max(rows - 1, 0).bit_length())
        return self._eager_scratch

    def _launches_for(self, num_rows: int) -> dict[str, _ModuleLaunches]:
        cached = self._launch_cache.get(num_rows)
        if cached is not None:
            return cached
        if len(self._launch_cache) >= _LAUNCH_CACHE_SIZE:
            self._launch_cache.clear()
        elem = self.dtype.itemsize
        launches: dict[str, _ModuleLaunches] = {}
        for name, s in self.specs.items():
            x_like, a_like, b_like = self._layouts.get(name, (None, None, None))
            if s.folded:
                plan = plan_pack(s.in_dim, s.stack, s.max_rank, s.extra_cols, elem)
                width = s.in_dim + s.extra_cols
                launches[name] = _ModuleLaunches(pack=prepare_pack(plan, num_rows, x_like, a_like, width, self.use_pdl))
            elif self._uses_token_kernels(s):
                cr = s.stack * s.max_rank
                shrink = prepare_shrink(plan_shrink(s.in_dim, cr, elem), num_rows, x_like, a_like, cr, s.stack,
                                        self.use_pdl)
                ep = plan_expand(s.out_dim, s.stack, s.max_rank, None if s.equal_slices else max(s.slice_sizes))
                expand = prepare_expand(ep, num_rows, b_like, cr, s.out_dim, not s.equal_slices, self.use_pdl)
                launches[name] = _ModuleLaunches(shrink=shrink, expand=expand)
            else:
                launches[name] = _ModuleLaunches()  # the subclass's own kernels (csgmv)
        self._launch_cache[num_rows] = launches
        return launches

    def _layout_tensors(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Empty tensors with the layouts (strides, dtypes) the layers pass to each module's
        token-major kernels: what a launch is prepared against, built once."""
        dev, dtype, out = self.device, self.dtype, {}
        for name, s in self.specs.items():
            if s.folded or self._uses_token_kernels(s):
                out[name] = (torch.empty((0, s.in_dim), dtype=dtype, device=dev),
                             torch.empty((0, s.stack * s.max_rank, s.in_dim), dtype=dtype, device=dev),
                             torch.empty((0, s.out_dim, s.max_rank), dtype=dtype, device=dev))
        return out

    # ---- the module call ---------------------------------------------------------------------
    def run_module(self, weights: LoRAModuleWeights, base_layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        spec, info, scratch = weights.spec, self.batch_info, self._scratch
        rows = x.shape[0]
        assert rows == info.num_rows, (rows, info.num_rows)
        if x.stride(1) != 1 or x.stride(0) != spec.in_dim:
            x = x.contiguous()  # the launches were prepared for dense rows (every model passes them)
        if rows == 0:
            return base_layer(x)
        launches = self._launches[spec.name]
        if spec.folded:
            x_aug = scratch.matrix(rows, spec.in_dim + spec.extra_cols)
            launches.pack(x, weights.A, x_aug, scratch.workspace, scratch.counters, info.token_slots,
                          info.lora_ranks, info.scalings)
            return F.linear(x_aug, weights.folded, weights.bias)
        out = base_layer(x)
        self._add_unfolded(weights, x, out, launches)
        return out

    def _add_unfolded(self, weights: LoRAModuleWeights, x: torch.Tensor, out: torch.Tensor,
                      launches: _ModuleLaunches) -> None:
        """out += LoRA delta of an unfolded module: token-major shrink, then expand in place."""
        spec, info, scratch = weights.spec, self.batch_info, self._scratch
        xa = scratch.matrix(x.shape[0], spec.stack * spec.max_rank)
        launches.shrink(x, weights.A, xa, scratch.workspace, scratch.counters, info.token_slots, info.lora_ranks)
        offsets = self._slice_offsets.get(spec.name, info.token_slots)  # unused for equal slices
        launches.expand(xa, weights.B, out, info.token_slots, info.lora_ranks, info.scalings, offsets)
