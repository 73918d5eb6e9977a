"""The token-major LoRA backend: `--lora-backend triton` (and `csgmv`'s folded modules, whose class
extends this one). The batch's rows are grouped into adapter segments once per forward, and each
wrapped module costs one LoRA kernel. Best where batches are short (decode, small prefills): every
launch is prepared once per batch and no host-side sorting is needed; compare `csgmv`.

Per module kind (qkv_proj, o_proj, gate_up_proj, down_proj), decided once at start-up
(LoRAMemoryPool, lora/fold.py; logged by the manager):
  folded    one `shrink_pack` kernel writes x_aug = [x | each row's pre-scaled shrink in its own
            slot's block], then ONE cuBLAS GEMM `F.linear(x_aug, W_aug, bias)` gives base output
            plus LoRA delta. No expand kernel, no read-modify-write of the output.
  unfolded  the base GEMM, then a token-major shrink and expand (triton_ops/token_*.py) added in
            place, split-K and, on Hopper, the expand as a programmatic dependent of the shrink;
            csgmv brings its own kernels here (chunked SGMV).

Metadata, built once per batch in `fill_batch_info` (where the forward's path reads it): the
segments of lora/segments.py (a row order grouped by slot, cut into runs of `segment_rows`), one
int32 buffer [permutation | seg_indptr | weight_indices] and one pinned host->device copy. Eagerly
it is a fresh buffer of the live rows and the grid spans the live segments; under the decode and
prefill graphs it is a static buffer covering every row the graph kind can hold, rewritten in
place, and a graph's grid spans the segment capacity of its bucket. Ranks and scalings are the
pool's device tensors (`init_modules`), updated only when a slot changes. Nothing in the metadata
counts requests, so the prefill graph's request cap is its token count.

Launches and buffers: per batch and module kind, the launches are prepared once (`PreparedLaunch`:
grid and ints fixed, kernels bound), cached by (rows, segments); layers only pass their tensors.
x_aug / shrink outputs, split-K partials and ticket counters live in a `_Scratch`: one per graph
kind, allocated with its static info before any capture and never reallocated; eager batches
borrow the prefill (or decode) graph's when they fit, else an eager one grown in prepare. Nothing is
allocated and nothing synchronises per LoRA call. Plans depend on static shapes only
(token_lora.py), so a padded graph replay and an eager pass compute every row bit for bit alike.

Triton compiles on first launch: the graph runners' warm-up runs (capture_graph) launch every
kernel on the capture stream before capture begins.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import torch
import torch.nn.functional as F

from sglang.srt.configs.forward_path import ForwardPath
from sglang.srt.lora.backend._staging import StagedCopy, to_device
from sglang.srt.lora.backend.base_backend import BaseLoRABackend
from sglang.srt.lora.segments import Segments, build_segments, idle_slot_of, int32_tensor, segment_capacity
from sglang.srt.lora.triton_ops.gemm_shrink import (GEMM_SHRINK_MAX_COLS, gemm_shrink_max_slots, gemm_shrink_pack,
                                                     gemm_shrink_width)
from sglang.srt.lora.triton_ops.fold_gemv import a_fold_gemv, fold_gemv
from sglang.srt.lora.triton_ops.launch import PreparedLaunch
from sglang.srt.lora.triton_ops.norm_shrink_pack import norm_shrink, norm_shrink_pack, silu_shrink, silu_shrink_pack
from sglang.srt.lora.triton_ops.token_lora import (
    SEGMENT_ROWS,
    pdl_available,
    plan_expand,
    plan_pack,
    plan_shrink,
    prepare_expand,
    prepare_pack,
    prepare_shrink,
)
from sglang.srt.lora.utils import DeferredDelta, LoRABatchInfo, LoRAModuleSpec, LoRAModuleWeights, PreparedInput

if TYPE_CHECKING:
    from sglang.srt.configs.forward_batch_info import ForwardBatch

_LAUNCH_CACHE_SIZE = 512  # distinct (rows, segments) kept: decode sizes, prefill buckets, live eager batches
# Programmatic dependent launch where the GPU has it (Hopper+): shrink_pack may start while the
# kernel before it drains (it waits before reading x), the unfolded expand while its shrink runs.
# The first H200 run measured tok+pdl ~15% faster than tok; SGLANG_LORA_PDL=0 launches everything
# plainly (benchmarks compare).
USE_PDL_BY_DEFAULT = os.environ.get("SGLANG_LORA_PDL", "1") != "0"
# SGLANG_LORA_ROWWISE_DECODE=small (the default): o_proj's and down_proj's row-wise kernels at
# decode batches whose graph bucket (eagerly: their rows, or the bucket they would take) holds at
# most this many rows. bench_norm_shrink (H200, 2026-12-01, Qwen3-4B, 8 adapters) measured them
# 190-206 µs per step cheaper than shrink_pack's segments at batch 1-8, even at 32, dearer from 64
# up; whole decode steps (profile_forward, seventh session) went 1.20 -> 1.15 of the base at batch 1
# and 1.24 -> 1.17 at 8, unchanged at 64. They round differently from the segments (error against
# float32 within the unfused engine's: H200 test), for graph and eager alike.
ROWWISE_SMALL_ROWS = 16
ROWWISE_DECODE_DEFAULT = "small"
# SGLANG_LORA_AFOLD=small (the default): at decode batches whose graph bucket holds at most this many
# rows, A-folded o_proj / down_proj (lora/fold.py, a_fold_views) run their one GEMM over [W; A of every
# slot] and leave the delta to the fused norm after them (lora/norm_fusion.py): no LoRA kernel of their
# own. bench_norm_shrink --afold (H200, 2026-12-04, 8 adapters, the four folded modules of every
# layer, µs of LoRA per step against the best of the other kernels): Qwen3-4B 343 / 509 at batch 1,
# 364 / 542 at 8, 486 / 681 at 16, 723 / 727 at 32, 1,256 / 914 at 64 (every program of a row sums
# the delta again); Llama-3.1-8B 498 / 525, 500 / 572, 595 / 686, then dearer.
AFOLD_SMALL_ROWS = 16
AFOLD_DEFAULT = "small"


def rowwise_decode_bound(value: str, small: int = ROWWISE_SMALL_ROWS,
                         name: str = "SGLANG_LORA_ROWWISE_DECODE") -> Optional[int]:
    """SGLANG_LORA_ROWWISE_DECODE (and SGLANG_LORA_AFOLD, `name`): "0" off (None), "1" every decode
    batch, "small" those of at most `small` rows, "rows:N" those of at most N rows (for measuring the
    crossover)."""
    bounds = {"0": None, "1": 1 << 30, "small": small}
    if value in bounds:
        return bounds[value]
    if value.startswith("rows:") and value[5:].isdigit() and int(value[5:]) > 0:
        return int(value[5:])
    raise ValueError(f"{name}={value!r}: use 0, 1, small or rows:N (N > 0)")


# SGLANG_LORA_GEMM_SHRINK: at prefills whose graph bucket holds at least this many tokens, a folded
# module whose norm (or SiLU-and-mul) wrote its input into x_aug (SGLANG_LORA_PACK_IN_PLACE) takes
# its shrink as one GEMM over every slot's A and a pack (triton_ops/gemm_shrink.py) in place of
# shrink_pack. "0" never, "1" every prefill, "tokens:T" from T tokens. H100, 9 slots of rank 16
# (bench_gemm_shrink.py, µs shrink_pack -> GEMM + pack): Qwen3-4B qkv_proj 10.3 -> 10.3 at 512
# rows, 15.1 -> 11.1 at 1,024, 75.2 -> 34.1 at 8,192; gate_up_proj 7.3 -> 9.0 at 512, 9.4 -> 9.8
# at 1,024, 44.4 -> 26.7 at 8,192; rank 64 wins from 512 rows. Whole prefill steps with 8 adapters:
# 4x512 LoRA / base 1.16 -> 1.14 (GPU busy 1.20 -> 1.15), 16x512 1.15 -> 1.14; at 128 tokens it
# loses (1.16 -> 1.19). Hence from buckets of 1,024 tokens.
GEMM_SHRINK_DEFAULT = "tokens:1024"


def token_bound(value: str, name: str, every: int, least: int = 1) -> Optional[int]:
    """A setting `name` of the form "0" (None: never), "1" (`every`) or "tokens:T" (T, at least
    `least`): a bound on the graph bucket of the batches that take a path."""
    if value in ("0", "1"):
        return None if value == "0" else every
    key, _, number = value.partition(":")
    if key != "tokens" or not number.isdigit() or int(number) < least:
        raise ValueError(f"{name}={value!r}: use 0, 1 or tokens:T (T >= {least})")
    return int(number)


def gemm_shrink_bound(value: str) -> Optional[int]:
    """SGLANG_LORA_GEMM_SHRINK's least bucket (None: never)."""
    return token_bound(value, "SGLANG_LORA_GEMM_SHRINK", every=0, least=0)


@dataclass
class _Scratch:
    """Per-call buffers for batches of up to `rows` rows (shared by every layer and module kind:
    each module's kernels finish with them before the next module's start, in stream order)."""

    rows: int
    flat: torch.Tensor  # x_aug of a folded module / shrink output of an unfolded one, row-major
    workspace: torch.Tensor  # fp32 split-K partials
    counters: torch.Tensor  # int32 tickets; zero between launches (each launch re-arms its own)
    gemm_y: Optional[torch.Tensor] = None  # the GEMM shrink's every-slot shrink (SGLANG_LORA_GEMM_SHRINK)

    def matrix(self, rows: int, width: int) -> torch.Tensor:
        return self.flat[: rows * width].view(rows, width)

    def gemm_shrink_out(self, rows: int, width: int) -> torch.Tensor:
        assert self.gemm_y is not None and rows * width <= self.gemm_y.numel(), (rows, width)
        return self.gemm_y[: rows * width].view(rows, width)


@dataclass
class _GraphMeta:
    """The static metadata of one graph kind (decode or prefill): the info its kernels read, the one
    int32 buffer behind the info's segment tensors, the rows it covers and its scratch."""

    info: LoRABatchInfo
    # [permutation (rows) | seg_indptr (capacity + 1) | weight_indices (capacity) | row_slots (rows,
    # the decode graph's with norm fusion only)]
    buffer: torch.Tensor
    rows: int
    capacity: int
    scratch: _Scratch
    staging: StagedCopy  # buffer's pinned host twin: the one host->device copy of a refresh
    # What `buffer` holds: the (request slots, request lengths, slot ranks) it was built from, and
    # its segment count. A decode step whose batch is the previous one's (most steps: requests
    # come and go every few steps) finds its metadata already in place.
    filled_for: Optional[tuple] = None
    filled_segments: int = 0


@dataclass
class _ModuleLaunches:
    pack: Optional[PreparedLaunch] = None  # folded
    pack_in_place: Optional[PreparedLaunch] = None  # folded, x already in x_aug (SGLANG_LORA_PACK_IN_PLACE)
    shrink: Optional[PreparedLaunch] = None  # unfolded, token-major
    expand: Optional[PreparedLaunch] = None


class TokenLoRABackend(BaseLoRABackend):
    name = "triton"  # --lora-backend triton is this class as it is; csgmv subclasses it
    supports_prefill_cuda_graph = True
    supports_fold = True
    supports_norm_fusion = True

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
        # Rows per segment: every kernel's tile of rows (csgmv: its chunk).
        self.segment_rows = SEGMENT_ROWS
        self.dtype: Optional[torch.dtype] = None
        self._slot_ranks: Optional[torch.Tensor] = None
        self._slot_scalings: Optional[torch.Tensor] = None
        self._slice_offsets: dict[str, torch.Tensor] = {}  # unequal slices (qkv), for the expand
        self._decode: Optional[_GraphMeta] = None
        self._prefill: Optional[_GraphMeta] = None
        self._eager_scratch: Optional[_Scratch] = None
        self._scratch: Optional[_Scratch] = None  # the current batch's
        self._launch_cache: dict[tuple[int, int], dict[str, _ModuleLaunches]] = {}
        self._layouts: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._launches: dict[str, _ModuleLaunches] = {}
        self.fuse_norm = False  # enable_norm_fusion
        # With norm fusion, the modules without a norm before them may take row-wise kernels at
        # decode too: down_proj's fused with the SiLU-and-mul before it (lora/norm_fusion.py), a
        # folded o_proj's in place of shrink_pack's segments. SGLANG_LORA_ROWWISE_DECODE=small
        # (the default) at small batches only, =1 at every decode batch, =0 never;
        # benchmark/lora/bench_norm_shrink.py measures them.
        self.rowwise_max_rows = rowwise_decode_bound(
            os.environ.get("SGLANG_LORA_ROWWISE_DECODE", ROWWISE_DECODE_DEFAULT))
        self.rowwise_decode = self.rowwise_max_rows is not None
        # A-folded o_proj / down_proj defer their delta to the norm after them at small decode
        # batches (SGLANG_LORA_AFOLD: 0, 1, small, rows:N; the pool lays out W_aug for it only when on).
        self.afold_max_rows = rowwise_decode_bound(os.environ.get("SGLANG_LORA_AFOLD", AFOLD_DEFAULT),
                                                   AFOLD_SMALL_ROWS, "SGLANG_LORA_AFOLD")
        # SGLANG_LORA_PACK_IN_PLACE (1 by default; 0 copies): where no kernel fuses the norm (prefill), the norm before a
        # folded qkv_proj / gate_up_proj and the SiLU-and-mul before a folded down_proj write their
        # output straight into x_aug's first columns (in_place_input), and shrink_pack only adds
        # the packed shrink: one write of the module's input rows less (T x K elements; at a
        # 8192-token prefill of the Qwen3-4B shape 160 MB per layer for down_proj alone).
        self.pack_in_place = os.environ.get("SGLANG_LORA_PACK_IN_PLACE", "1") == "1"
        self.gemm_shrink_min_tokens = gemm_shrink_bound(os.environ.get("SGLANG_LORA_GEMM_SHRINK", GEMM_SHRINK_DEFAULT))
        # SGLANG_LORA_FOLD_GEMV (1 by default; 0 keeps cuBLAS): a folded module's GEMM for a
        # one-row decode batch reads W and the row's own slot block only (triton_ops/fold_gemv.py),
        # not every slot's B. Decided by the batch's row count, so graph and eager alike.
        self.fold_gemv = os.environ.get("SGLANG_LORA_FOLD_GEMV", "1") == "1"
        # SGLANG_LORA_AFOLD_GEMV (1 by default; 0 keeps cuBLAS): likewise an A-folded o_proj /
        # down_proj's GEMM over [W; A of every slot] reads W and the row's slot's A only. One-request
        # steps on an H100: GPU busy -107 µs on Qwen3-4B, -51 µs on the 8B (docs/lora-kernel-paths.md).
        self.afold_gemv = os.environ.get("SGLANG_LORA_AFOLD_GEMV", "1") == "1"
        self._gemm_shrink_now = False  # this batch is a prefill the bound admits
        self._gemm_shrink_cols: dict[str, int] = {}  # per module kind, set by init_modules
        self._decode_buckets: list[int] = []  # the decode graphs' batch sizes, for rowwise_fits
        self._row_plans: dict[tuple[int, bool], tuple[bool, bool, int]] = {}  # _row_plan_for's
        self._prefill_buckets: list[int] = []  # the prefill graphs' token counts, for prefill_bucket

    def enable_norm_fusion(self) -> None:
        """Decode batches carry each row's slot, for the norm kernels that write x_aug themselves
        (lora/norm_fusion.py). Before the graphs' static infos are allocated."""
        assert self._decode is None, "enable_norm_fusion runs before init_cuda_graph_batch_info"
        self.fuse_norm = True  # _row_plan_for's key carries it: no cached plan to drop

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
            if not spec.equal_slices:  # folded ones too: a subclass may expand them apart (csgmv)
                self._slice_offsets[name] = torch.tensor(spec.slice_offsets, dtype=torch.int32, device=self.device)
        self._layouts = self._layout_tensors()
        self._xaug_like = {name: torch.empty((0, s.in_dim + s.extra_cols), dtype=dtype, device=self.device)
                           for name, s in self.specs.items() if s.folded}
        # y's width per module kind that may take the GEMM shrink (SGLANG_LORA_GEMM_SHRINK); 0 never.
        self._gemm_shrink_cols = {name: self._gemm_shrink_width(s) for name, s in self.specs.items()}

    def segment_capacity(self, rows: int) -> int:
        """Most segments a batch of `rows` rows can take (lora/segments.py)."""
        return segment_capacity(rows, self.segment_rows, self._slot_ranks.numel())

    def _scratch_for(self, rows: int) -> _Scratch:
        width = max((s.in_dim + s.extra_cols if s.folded else s.stack * s.max_rank) for s in self.specs.values())
        workspace = counters = 1
        elem = self.dtype.itemsize
        for s in self.specs.values():
            if s.folded or self._uses_token_kernels(s):
                plan = plan_shrink(s.in_dim, s.stack * s.max_rank, elem, self.segment_rows)
                workspace = max(workspace, plan.workspace_numel(rows))
                counters = max(counters, plan.num_counters(self.segment_capacity(rows)))
        dev = self.device
        gemm_cols = max(self._gemm_shrink_cols.values(), default=0)
        return _Scratch(
            rows,
            torch.empty(rows * width, dtype=self.dtype, device=dev),
            torch.empty(workspace, dtype=torch.float32, device=dev),
            torch.zeros(counters, dtype=torch.int32, device=dev),
            torch.empty(rows * gemm_cols, dtype=self.dtype, device=dev) if gemm_cols else None,
        )

    def _gemm_shrink_width(self, spec: LoRAModuleSpec) -> int:
        """y's width where `spec` may take the GEMM shrink (SGLANG_LORA_GEMM_SHRINK), else 0."""
        if self.gemm_shrink_min_tokens is None or not spec.folded or not self.pack_in_place:
            return 0
        slots = self._slot_ranks.numel() - 1
        cols = gemm_shrink_width(slots, spec.stack, spec.max_rank)
        return cols if cols <= GEMM_SHRINK_MAX_COLS and slots <= gemm_shrink_max_slots(spec.stack) else 0

    def _uses_token_kernels(self, spec: LoRAModuleSpec) -> bool:
        """Whether an unfolded module runs the token-major shrink/expand (subclasses may not)."""
        return True

    def _runs_folded(self, spec: LoRAModuleSpec) -> bool:
        """Whether a module takes its fold in the current batch. Here: whenever it is folded. A
        subclass may run a folded module apart for some batches (csgmv at prefill); the choice
        may depend only on what a graph and an eager pass of a batch share: its mode and its
        graph bucket (`prefill_bucket`)."""
        return spec.folded

    # ---- static infos ------------------------------------------------------------------------
    def _graph_meta(self, rows: int, with_row_slots: bool = False) -> _GraphMeta:
        cap = self.segment_capacity(rows)
        end = rows + 2 * cap + 1
        buffer = torch.zeros(end + (rows if with_row_slots else 0), dtype=torch.int32, device=self.device)
        info = LoRABatchInfo(
            rows, self._slot_ranks, self._slot_scalings, use_cuda_graph=True, bs=cap, max_len=self.segment_rows,
            permutation=buffer[:rows], seg_indptr=buffer[rows : rows + cap + 1], weight_indices=buffer[rows + cap + 1 : end],
            row_slots=buffer[end:] if with_row_slots else None,
        )
        return _GraphMeta(info, buffer, rows, cap, self._scratch_for(rows), StagedCopy(buffer))

    def init_cuda_graph_batch_info(self, max_bs_in_cuda_graph: int, num_tokens_per_bs: int = 1,
                                   buckets: Optional[Sequence[int]] = None) -> None:
        self._decode_buckets = sorted(buckets or [])
        self._row_plans.clear()  # rowwise / defer follow the buckets
        self._decode = self._graph_meta(max_bs_in_cuda_graph * num_tokens_per_bs, with_row_slots=self.fuse_norm)
        self.cuda_graph_batch_info = self._decode.info
        self.max_bs_in_cuda_graph = max_bs_in_cuda_graph

    def init_prefill_cuda_graph_batch_info(self, max_num_tokens: int, buckets: Optional[Sequence[int]] = None) -> None:
        self._prefill_buckets = sorted(buckets or [])
        self._prefill = self._graph_meta(max_num_tokens)
        self.prefill_cuda_graph_batch_info = self._prefill.info
        # Segments have no per-request part: every request has >= 1 token, so the bucket's token
        # count is also its request cap.
        self.prefill_cuda_graph_max_bs = max_num_tokens
        self.prefill_cuda_graph_max_tokens = max_num_tokens

    # ---- per-forward metadata ----------------------------------------------------------------
    def fill_batch_info(
        self,
        forward_batch: "ForwardBatch",
        weight_indices: list[int],
        lora_ranks: list[int],
        scalings: list[float],
        path: ForwardPath,
    ) -> None:
        """Set `self.batch_info`: the batch's segments, where `path` reads them, and the
        launches of every module kind for this batch. `lora_ranks` (host list) decides which rows
        are active; `scalings` is not read: the kernels read the pool's device tensors."""
        assert self.specs, "init_modules must run before the first batch"
        # The host work here runs before every LoRA forward while the GPU waits (before a graph
        # replay, all of it is): an unchanged graph batch only builds its key and compares.
        bs = forward_batch.batch_size
        assert len(weight_indices) == bs, (len(weight_indices), bs)
        num_rows = forward_batch.num_tokens
        extend = forward_batch.forward_mode.is_extend()
        # Decode rows are requests: each row's slot, for the fused norm kernels.
        fused = self.fuse_norm and not extend
        assert not fused or num_rows == bs, (num_rows, bs)
        rowwise, defer, capacity = self._row_plan_for(num_rows, fused)
        bound = self.gemm_shrink_min_tokens
        self._gemm_shrink_now = bound is not None and extend and self.prefill_bucket(num_rows) >= bound
        if path.is_graph:
            meta = self._decode if path is ForwardPath.DECODE_GRAPH else self._prefill
            assert meta is not None, "init_*_cuda_graph_batch_info must run before a graph batch"
            assert path is ForwardPath.DECODE_GRAPH or extend, forward_batch.forward_mode
            assert num_rows <= meta.rows, (num_rows, meta.rows)
            lens = self._request_lens(forward_batch) if extend else None
            key = (tuple(weight_indices), tuple(lens) if extend else num_rows, tuple(lora_ranks))
            self.metadata_refreshes += 1
            if key != meta.filled_for:
                self.metadata_writes += 1
                idle = idle_slot_of(lora_ranks)
                # The static segments cover every row the graph kind holds (padding in row order), so
                # any bucket's grid finds all of its rows in its first segment_capacity(bucket) segments.
                segs = build_segments(weight_indices, lens if extend else [1] * bs, lora_ranks, self.segment_rows,
                                      meta.rows, idle, one_row_each=not extend or None)
                assert segs.num_segments <= meta.capacity, (segs.num_segments, meta.capacity)
                row_slots = weight_indices + [-1] * (meta.rows - bs) if meta.info.row_slots is not None else None
                meta.staging.write(self._packed(segs, meta.capacity, idle, row_slots))
                meta.filled_for, meta.filled_segments = key, segs.num_segments
            info, scratch = meta.info, meta.scratch
            info.num_rows, info.num_segments = num_rows, meta.filled_segments
            info.rowwise, info.defer = rowwise, defer
            # The grid's segment axis for this row count: at capture, the bucket's capacity.
            info.bs = capacity
        else:
            idle = idle_slot_of(lora_ranks)
            segs = build_segments(weight_indices, self._request_lens(forward_batch), lora_ranks, self.segment_rows,
                                  num_rows, idle)
            n = segs.num_segments
            end = num_rows + 2 * n + 1
            packed = to_device(self._packed(segs, n, idle, weight_indices if fused else None), torch.int32, self.device)
            info = LoRABatchInfo(
                num_rows, self._slot_ranks, self._slot_scalings, bs=n, num_segments=n, max_len=self.segment_rows,
                permutation=packed[:num_rows], seg_indptr=packed[num_rows : num_rows + n + 1],
                weight_indices=packed[num_rows + n + 1 : end], row_slots=packed[end:] if fused else None,
                rowwise=rowwise, defer=defer,
            )
            scratch = self._eager_scratch_for(num_rows)
        self._scratch = scratch
        self._launches = self._launches_for(num_rows, info.bs)
        self.batch_info = info

    @staticmethod
    def _packed(segs: Segments, capacity: int, idle: int, row_slots: Optional[list[int]] = None) -> torch.Tensor:
        """[permutation | seg_indptr | weight_indices (| row_slots)], the segment lists padded to
        `capacity` with empty segments of the idle slot (a larger earlier batch's segments never
        run again)."""
        pad = capacity - segs.num_segments
        tail = segs.seg_indptr + [segs.seg_indptr[-1]] * pad + segs.weight_indices + [idle] * pad
        return torch.cat([segs.permutation, int32_tensor(tail + (row_slots or []))])

    def _eager_scratch_for(self, rows: int) -> _Scratch:
        for meta in (self._prefill, self._decode):
            if meta is not None and meta.scratch.rows >= rows:
                return meta.scratch
        if self._eager_scratch is None or self._eager_scratch.rows < rows:
            # Grown to the next power of two, so a run of growing prefills reallocates rarely.
            self._eager_scratch = self._scratch_for(1 << max(rows - 1, 0).bit_length())
        return self._eager_scratch

    def _launches_for(self, num_rows: int, num_segments: int) -> dict[str, _ModuleLaunches]:
        key = (num_rows, num_segments)
        cached = self._launch_cache.get(key)
        if cached is not None:
            return cached
        if len(self._launch_cache) >= _LAUNCH_CACHE_SIZE:
            self._launch_cache.clear()
        elem, block_s = self.dtype.itemsize, self.segment_rows
        launches: dict[str, _ModuleLaunches] = {}
        for name, s in self.specs.items():
            x_like, a_like, b_like = self._layouts.get(name, (None, None, None))
            if s.folded:
                plan = plan_pack(s.in_dim, s.stack, s.max_rank, s.extra_cols, elem, block_s)
                width = s.in_dim + s.extra_cols
                launches[name] = _ModuleLaunches(
                    pack=prepare_pack(plan, num_rows, num_segments, x_like, a_like, width, self.use_pdl),
                    pack_in_place=(prepare_pack(plan, num_rows, num_segments, self._xaug_like[name][:, : s.in_dim],
                                                a_like, width, self.use_pdl, copy_x=False)
                                   if self.pack_in_place else None),
                )
            elif self._uses_token_kernels(s):
                cr = s.stack * s.max_rank
                shrink = prepare_shrink(plan_shrink(s.in_dim, cr, elem, block_s), num_rows, num_segments, x_like,
                                        a_like, cr, s.stack, self.use_pdl)
                ep = plan_expand(s.out_dim, s.stack, s.max_rank, None if s.equal_slices else max(s.slice_sizes),
                                 block_s)
                expand = prepare_expand(ep, num_rows, num_segments, b_like, cr, s.out_dim, not s.equal_slices,
                                        self.use_pdl)
                launches[name] = _ModuleLaunches(shrink=shrink, expand=expand)
            else:
                launches[name] = _ModuleLaunches()  # the subclass's own kernels (csgmv)
        self._launch_cache[key] = launches
        return launches

    def _layout_tensors(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Empty tensors with the layouts (strides, dtypes) the layers pass to each module's
        token-major kernels: what a launch is prepared against, built once."""
        dev, dtype, out = self.device, self.dtype, {}
        for name, s in self.specs.items():
            if s.folded or self._uses_token_kernels(s):
                cr, row = s.stack * s.max_rank, s.a_row_stride or s.in_dim
                out[name] = (torch.empty((0, s.in_dim), dtype=dtype, device=dev),
                             torch.empty_strided((0, cr, s.in_dim), (cr * row, row, 1), dtype=dtype, device=dev),
                             torch.empty((0, s.out_dim, s.max_rank), dtype=dtype, device=dev))
        return out

    def rowwise_fits(self, rows: int) -> bool:
        """Whether a decode batch of `rows` rows takes the row-wise o_proj / down_proj kernels: its
        decode graph bucket (the smallest >= rows; rows past the largest: their own count) is
        within the bound. A batch and the graph bucket it replays decide alike, so graph = eager
        holds on one server; two servers with other bucket ladders may decide a size differently."""
        return self._bucket_within(rows, self.rowwise_max_rows)

    def _row_plan_for(self, num_rows: int, fused: bool) -> tuple[bool, bool, int]:
        """(rowwise, defer, segment capacity) of a batch of `num_rows` rows: functions of the row
        count and of settings fixed before the first batch (the decode buckets, the norm fusion),
        so computed once per count."""
        key = (num_rows, fused)
        plan = self._row_plans.get(key)
        if plan is None:
            if len(self._row_plans) >= _LAUNCH_CACHE_SIZE:
                self._row_plans.clear()
            plan = (fused and self.rowwise_fits(num_rows), fused and self._bucket_within(num_rows, self.afold_max_rows),
                    self.segment_capacity(num_rows))
            self._row_plans[key] = plan
        return plan

    def _bucket_within(self, rows: int, bound: Optional[int]) -> bool:
        if bound is None:
            return False
        padded = next((b for b in self._decode_buckets if b >= rows), rows)
        return padded <= bound

    @property
    def a_fold(self) -> bool:
        """Whether the pool should lay out A-folded modules (SGLANG_LORA_AFOLD not 0)."""
        return self.afold_max_rows is not None

    def prefill_bucket(self, tokens: int) -> int:
        """The prefill graph bucket a batch of `tokens` tokens takes (past the largest, or without
        prefill graphs: its own count), so a rule on it decides a batch and its replay alike."""
        return next((b for b in self._prefill_buckets if b >= tokens), tokens)

    def rowwise_now(self) -> bool:
        info = self.batch_info
        return info is not None and info.rowwise

    # ---- the norm fused with the module's shrink (decode) --------------------------------------
    def fuses_norm(self) -> bool:
        info = self.batch_info
        return info is not None and info.row_slots is not None

    def defers(self, weights: LoRAModuleWeights) -> bool:
        info = self.batch_info
        return info is not None and info.defer and weights.a_folded is not None and weights.spec.stack == 1

    def run_deferred(self, weights: LoRAModuleWeights, x: torch.Tensor) -> tuple[torch.Tensor, DeferredDelta]:
        base, shrink = self._a_folded_gemm(weights, x)
        return base, DeferredDelta(shrink, weights.bt, self._slot_scalings, weights.spec.max_rank)

    def _a_folded_gemm(self, weights: LoRAModuleWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the base output, every adapter slot's unscaled shrink): views of one GEMM over [W; A].
        With SGLANG_LORA_AFOLD_GEMV at a one-row decode batch, the GEMV that reads W and the row's
        own slot's A (the other slots' shrink is zeros: what reads it takes the row's block only)."""
        assert weights.bias is None, "an A-folded module has no bias"
        spec, n = weights.spec, weights.spec.out_dim
        slot = self._one_row_slot(x) if self.afold_gemv else None
        if slot is not None:
            out = a_fold_gemv(x.contiguous(), weights.a_folded, n, slot, spec.stack * spec.max_rank)
        else:
            out = F.linear(x, weights.a_folded)  # [x W^T | x A^T of every adapter slot]
        return out[:, :n], out[:, n:]

    def run_norm(self, weights: LoRAModuleWeights, norm_weight: torch.Tensor, eps: float, x: torch.Tensor,
                 residual: Optional[torch.Tensor], delta: Optional[DeferredDelta] = None
                 ) -> tuple[PreparedInput, Optional[torch.Tensor]]:
        spec, info = weights.spec, self.batch_info
        rows = x.shape[0]
        assert rows == info.num_rows and x.dim() == 2, (x.shape, info.num_rows)
        slots = info.row_slots[:rows]
        if spec.folded:
            # The scratch x_aug: read by the module's GEMM, the very next kernel (as shrink_pack's is).
            x_aug = self._scratch.matrix(rows, spec.in_dim + spec.extra_cols)
            new_residual = norm_shrink_pack(x, residual, norm_weight, eps, weights.A, x_aug, slots, self._slot_ranks,
                                            self._slot_scalings, spec.stack, spec.max_rank, use_pdl=self.use_pdl,
                                            delta=delta)
            return PreparedInput(x_aug[:, : spec.in_dim], x_aug=x_aug), new_residual
        # Unfolded: the shrink output in the scratch, read by the expand after the base GEMM.
        normed = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # dense, whatever x's row stride
        xa = self._scratch.matrix(rows, spec.stack * spec.max_rank)
        new_residual = norm_shrink(x, residual, norm_weight, eps, weights.A, normed, xa, slots, self._slot_ranks,
                                   spec.stack, spec.max_rank, use_pdl=self.use_pdl, delta=delta)
        return PreparedInput(normed, xa=xa), new_residual

    def run_act(self, weights: LoRAModuleWeights, gate_up: torch.Tensor) -> PreparedInput:
        spec, info = weights.spec, self.batch_info
        rows, d = gate_up.shape[0], gate_up.shape[1] // 2
        assert rows == info.num_rows and gate_up.dim() == 2 and d == spec.in_dim, (gate_up.shape, spec.in_dim)
        slots = info.row_slots[:rows]
        if spec.folded:
            x_aug = self._scratch.matrix(rows, spec.in_dim + spec.extra_cols)
            silu_shrink_pack(gate_up, weights.A, x_aug, slots, self._slot_ranks, self._slot_scalings, spec.max_rank,
                             use_pdl=self.use_pdl)
            return PreparedInput(x_aug[:, :d], x_aug=x_aug)
        act = torch.empty((rows, d), dtype=gate_up.dtype, device=gate_up.device)
        xa = self._scratch.matrix(rows, spec.max_rank)
        silu_shrink(gate_up, weights.A, act, xa, slots, self._slot_ranks, spec.max_rank, use_pdl=self.use_pdl)
        return PreparedInput(act, xa=xa)

    def in_place_input(self, weights: LoRAModuleWeights, rows: int) -> Optional[PreparedInput]:
        spec, info = weights.spec, self.batch_info
        # Only where nothing fuses (no row slots: prefill) and the module runs folded: functions of
        # the batch's mode and bucket, so a graph and an eager pass of a batch decide alike.
        if (not self.pack_in_place or info is None or info.row_slots is not None or info.rowwise or info.defer
                or rows == 0 or rows != info.num_rows or not self._runs_folded(spec)
                # An A-folded qkv_proj's GEMM over [W; A] computes its shrink: no x_aug. (Whether an
                # A-folded o_proj / down_proj takes its expand also hangs on the layer's
                # defers_to_norm, which its callers in norm_fusion.py check.)
                or (spec.stack > 1 and self.expands_a_folded(weights))):
            return None
        x_aug = self._scratch.matrix(rows, spec.in_dim + spec.extra_cols)
        return PreparedInput(x_aug[:, : spec.in_dim], x_aug=x_aug, pack_pending=True)

    def run_prepared(self, weights: LoRAModuleWeights, prepared: PreparedInput, base_layer: torch.nn.Module) -> torch.Tensor:
        if prepared.x_aug is not None:
            if prepared.pack_pending:  # the rows are in place: shrink_pack adds only the shrink
                info, scratch, spec = self.batch_info, self._scratch, weights.spec
                cols = self._gemm_shrink_cols[spec.name]
                if self._gemm_shrink_now and cols:
                    gemm_shrink_pack(prepared.x_aug, spec.in_dim, weights.A,
                                     scratch.gemm_shrink_out(prepared.x_aug.shape[0], cols), info.permutation,
                                     info.seg_indptr, info.weight_indices, info.lora_ranks, info.scalings,
                                     spec.stack, spec.max_rank, self._slot_ranks.numel() - 1, info.bs,
                                     self.segment_rows)
                    return self._folded_gemm(weights, prepared.x_aug)
                self._launches[weights.spec.name].pack_in_place(
                    prepared.normed, weights.A, prepared.x_aug, scratch.workspace, scratch.counters,
                    info.permutation, info.seg_indptr, info.weight_indices, info.lora_ranks, info.scalings)
            return self._folded_gemm(weights, prepared.x_aug)
        out = base_layer(prepared.normed)
        self._expand_unfolded(weights, prepared.xa, out, self._launches[weights.spec.name])
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
        if self._runs_folded(spec):
            x_aug = scratch.matrix(rows, spec.in_dim + spec.extra_cols)
            if info.rowwise:
                norm_shrink_pack(x, None, None, 0.0, weights.A, x_aug, info.row_slots[:rows], info.lora_ranks,
                                 info.scalings, spec.stack, spec.max_rank, use_pdl=self.use_pdl)
            else:
                launches.pack(x, weights.A, x_aug, scratch.workspace, scratch.counters, info.permutation,
                              info.seg_indptr, info.weight_indices, info.lora_ranks, info.scalings)
            return self._folded_gemm(weights, x_aug)
        out = base_layer(x)
        self._add_unfolded(weights, x, out, launches)
        return out

    def _folded_gemm(self, weights: LoRAModuleWeights, x_aug: torch.Tensor) -> torch.Tensor:
        """The folded GEMM `x_aug @ W_aug^T (+ bias)`: at a one-row decode batch (its slot on the
        device in row_slots) the GEMV that reads the row's own slot block only, else cuBLAS."""
        spec = weights.spec
        slot = self._one_row_slot(x_aug) if self.fold_gemv else None
        if slot is not None:
            return fold_gemv(x_aug, weights.folded, spec.in_dim, slot, self._slot_ranks.numel() - 1,
                             spec.stack * spec.max_rank, weights.bias)
        return F.linear(x_aug, weights.folded, weights.bias)

    def _one_row_slot(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The row's slot (row_slots[:1], on the device) when `x` is a one-row decode batch whose rows
        carry their slot: where the one-row GEMVs (triton_ops/fold_gemv.py) run; else None."""
        info = self.batch_info
        if x.shape[0] != 1 or info is None or info.row_slots is None:
            return None
        return info.row_slots[:1]

    def _add_unfolded(self, weights: LoRAModuleWeights, x: torch.Tensor, out: torch.Tensor,
                      launches: _ModuleLaunches) -> None:
        """out += LoRA delta of an unfolded module: token-major shrink, then expand in place."""
        spec, info, scratch = weights.spec, self.batch_info, self._scratch
        xa = scratch.matrix(x.shape[0], spec.stack * spec.max_rank)
        segments = (info.permutation, info.seg_indptr, info.weight_indices)
        launches.shrink(x, weights.A, xa, scratch.workspace, scratch.counters, *segments, info.lora_ranks)
        self._expand_unfolded(weights, xa, out, launches)

    def _expand_unfolded(self, weights: LoRAModuleWeights, xa: torch.Tensor, out: torch.Tensor,
                         launches: _ModuleLaunches) -> None:
        """out += each row's scaling * xa @ B^T: the expand half of an unfolded module."""
        spec, info = weights.spec, self.batch_info
        segments = (info.permutation, info.seg_indptr, info.weight_indices)
        offsets = self._slice_offsets.get(spec.name, info.seg_indptr)  # unused for equal slices
        launches.expand(xa, weights.B, out, *segments, info.lora_ranks, info.scalings, offsets)
