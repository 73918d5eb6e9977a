"""`csgmv` LoRA backend (chunked SGMV): the token-major backend, whose UNFOLDED modules run the
chunked SGMV kernels.

Folded modules (the usual case, see lora/fold.py) are the same as `triton`'s: shrink_pack + one
GEMM over the batch's segments. What differs is the fallback for modules over the fold bound (many
slots x high rank) or with `--lora-fold off`, and the segment size: the batch's rows are sorted by
adapter (lora/segments.py), whatever request they came from, and each slot's run is cut into
chunks of `--max-lora-chunk-size` rows; every chunk is one segment (one program column of the
grid), and the segmented shrink and expand (triton_ops/sgemm_lora_{a,b}.py) reduce all of K per
chunk, with no split. Adapters' weight tiles are shared across requests, which pays off on long
prefills. Segments of rank-0 slots (the base model, padding) return at once.

At prefill (SGLANG_LORA_PREFILL_UNFOLD, off by default: on the H200, 2026-12-02, it cost 3% of
a server's requests/s at 8 slots and gained 2% at 64) a folded module may run apart too: the base
GEMM over W_aug[:, :K] (the base layer's weight), the chunked shrink with the pool's A and the
chunked expand reading B in place inside W_aug (fold.folded_b). At long prefills W_aug's extra
columns cost FLOPs (2*T*N*E) and shrink_pack copies x, where the expand costs one
read-modify-write of the output (lora/fold.py); decode keeps the fold. `1`: every folded module at
every prefill; `cols:N`: those with more than N extra columns; `tokens:T`: at prefills whose graph
bucket (eagerly: the bucket the batch would take; past the largest, its own token count) holds at
least T tokens, so a batch and the graph it replays decide alike; both joined by a comma; `0`:
never.

The chunk size is the same eagerly and under graphs, so a graph replay and an eager pass add the
same bits. Graph modes keep the static segment buffers of the token-major backend; the refresh
writes the live segments and leaves every other segment empty, under a rank-0 slot, so segments
of an earlier, larger batch are never re-applied (upstream bug #28371).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from sglang.srt.configs.forward_path import ForwardPath
from sglang.srt.lora.backend.token_backend import TokenLoRABackend, _ModuleLaunches, rowwise_decode_bound, token_bound
from sglang.srt.lora.fold import folded_b
from sglang.srt.lora.triton_ops import chunked_sgmv_lora_expand_forward, chunked_sgmv_lora_shrink_forward
from sglang.srt.lora.triton_ops.expand_silu import segmented_expand_silu
from sglang.srt.lora.utils import LoRAModuleSpec, LoRAModuleWeights, PreparedInput

if TYPE_CHECKING:
    from sglang.srt.configs.forward_batch_info import ForwardBatch


# SGLANG_LORA_AFOLD_PREFILL=small: prefills of up to this many tokens (their graph bucket), where
# shrink_pack's latency outweighs the A-fold's extra GEMM rows.
AFOLD_PREFILL_SMALL_TOKENS = 512
# SGLANG_LORA_CSGMV_SPLIT_SHRINK: which batches' unfolded modules (many slots, a high rank, or
# `--lora-fold off`) take the token backend's split-K shrink in place of the chunked one. The
# chunked shrink gives each chunk of 16 rows one program that walks all of K: a short prefill on one
# adapter is a few dozen programs on 132 SMs, each ten K tiles deep; the split-K plan spreads K over
# more programs, for a ticket and a finishing sum in a fixed order (the same bits under a graph and
# eagerly). H100, Qwen3-4B, 64 slots (qkv / gate_up unfolded), µs of the two shrinks per step,
# chunked -> split-K: prefill 128 623 -> 370 (step / base 1.36 -> 1.30), 512 642 -> 608 (1.33 ->
# 1.31), 4x512 767 -> 1,547 (1.23 -> 1.25), 16x512 1,986 -> 5,344 (1.19 -> 1.22): long prefills have
# chunks enough to fill the GPU, and there the split's partial sums cost more than they spread.
# Decode batches take the fused norm's shrink (norm_shrink_pack) unless the norms run apart. "0"
# never, "1" every batch, "tokens:T" decode batches and prefills whose graph bucket holds at most T
# tokens.
SPLIT_SHRINK_DEFAULT = "tokens:512"
# SGLANG_LORA_AFOLD_QKV: qkv_proj's prefills as the A-fold (fold.A_FOLD_PREFILL_MODULES): its GEMM
# over [W; A] and the expand of every slot's shrink, in place of the norm into x_aug, shrink_pack and
# the GEMM over W_aug. "0" never (the pool keeps the plain fold), "1" every prefill, "tokens:T"
# prefills whose graph bucket holds at most T tokens. H100, 2026-12-06, 8 rank-16 adapters on 9
# slots, step LoRA / base wall (GPU busy), default -> A-fold: Qwen3-4B prefill 128 1.22 -> 1.18,
# 512 1.22 -> 1.21, 4x512 1.15 -> 1.15 (busy 1.15 -> 1.17: the wider GEMM and the expand's
# read-modify-write outgrow shrink_pack's launch); Llama-3.1-8B prefill 128 1.16 -> 1.16 (busy 1.15
# -> 1.13), 256 1.16 -> 1.16 (1.17 -> 1.15), 512 1.13 -> 1.13 (1.16 -> 1.14), 1024 1.11 -> 1.10
# (1.12 -> 1.09). Decode keeps the fused norm (its steps tie).
AFOLD_QKV_DEFAULT = "tokens:1024"
# SGLANG_LORA_EXPAND_SILU: which batches' unfolded gate_up_proj leaves its expand to the SiLU-and-mul
# (triton_ops/expand_silu.py). "0" never, "1" every batch but the row-wise decode ones, "tokens:T"
# prefills whose graph bucket holds at least T tokens. H100, Qwen3-4B, 64 slots (2026-12-06), step
# LoRA / base without -> with it: prefill 512 1.33 -> 1.33, 2048 1.21 -> 1.18, 4x512 1.25 -> 1.22,
# 16x512 1.20 -> 1.16; a decode step of 64 requests on 32 adapters 1.33 -> 1.37 (the fused kernel's
# per-segment tiles read the few rows of each adapter 16 at a time, where the plain SiLU-and-mul
# runs dense). Hence prefills from buckets of 1,024 tokens.
EXPAND_SILU_DEFAULT = "tokens:1024"


class ChunkedSgmvLoRABackend(TokenLoRABackend):
    name = "csgmv"

    def __init__(
        self,
        max_loras_per_batch: int,
        device: torch.device | str,
        max_lora_chunk_size: int = 16,
        use_pdl: Optional[bool] = None,
    ) -> None:
        # Before the base class's setup, which asks _uses_token_kernels.
        self.split_shrink_max = split_shrink_bound(os.environ.get("SGLANG_LORA_CSGMV_SPLIT_SHRINK",
                                                                  SPLIT_SHRINK_DEFAULT))
        self._split_shrink_now = False  # this batch's unfolded modules take the split-K shrink
        super().__init__(max_loras_per_batch, device, max_lora_chunk_size, use_pdl)
        self.segment_rows = max_lora_chunk_size
        # Which folded modules run apart at which prefills (None: never).
        self.prefill_unfold = parse_prefill_unfold(os.environ.get("SGLANG_LORA_PREFILL_UNFOLD", "0"))
        self._unfold_now = False  # this batch is a prefill the rule's token bound admits
        # SGLANG_LORA_AFOLD_EXPAND (1, the default; 0 off): at decode batches past SGLANG_LORA_AFOLD's
        # bound, an A-folded o_proj / down_proj runs its GEMM over [W; A] and the segmented expand of
        # every slot's shrink into the base output, in place of shrink_pack (split-K over K) and the
        # GEMM over W_aug. On the H200 a decode step of 64 requests on 8 adapters went 1.21 -> 1.17 of
        # the base (Qwen3-4B) and 1.17 -> 1.13 (8B); at 32, 1.18 -> 1.17 and 1.14 -> 1.13.
        self.afold_expand = os.environ.get("SGLANG_LORA_AFOLD_EXPAND", "1") != "0"
        # SGLANG_LORA_AFOLD_PREFILL (0 until measured; 1 every prefill, small those whose graph bucket
        # holds at most AFOLD_PREFILL_SMALL_TOKENS tokens, rows:N at most N): prefills take that path
        # too. It trades shrink_pack's split-K latency (about 5-8 µs per launch at 128 rows, H200)
        # for the expand's read-modify-write of the output and S*R more GEMM rows, whose FLOPs
        # (2*T*S*R*K) outgrow the B fold's (2*T*N*E) at long prefills. Its output is a strided view,
        # which the plain norm after the module reads in place; with SGLANG_LORA_PACK_IN_PLACE that
        # norm also writes the next module's x_aug directly (else that module copies its input).
        self.afold_prefill_max = rowwise_decode_bound(os.environ.get("SGLANG_LORA_AFOLD_PREFILL", "1"),
                                                      AFOLD_PREFILL_SMALL_TOKENS, "SGLANG_LORA_AFOLD_PREFILL")
        self._afold_prefill_now = False  # this batch is a prefill the bound admits
        # SGLANG_LORA_AFOLD_QKV (see AFOLD_QKV_DEFAULT): qkv_proj takes the A-fold's layout and, at
        # the prefills its bound admits, its GEMM over [W; A] and the expand.
        self.afold_qkv_max = afold_qkv_bound(os.environ.get("SGLANG_LORA_AFOLD_QKV", AFOLD_QKV_DEFAULT))
        self.a_fold_prefill = self.afold_qkv_max is not None
        self._afold_qkv_now = False  # this batch is a prefill that bound admits
        # SGLANG_LORA_EXPAND_SILU (see EXPAND_SILU_DEFAULT): an unfolded gate_up_proj leaves its
        # expand to the SiLU-and-mul after it, which adds the delta to the tile it reads and writes
        # only the activation (triton_ops/expand_silu.py): no read-modify-write of gate_up's
        # output, one launch less per layer. The same bits as the expand, then the activation, so
        # the bound may split batches by size without a graph and its eager pass parting.
        self.expand_silu_min = expand_silu_bound(os.environ.get("SGLANG_LORA_EXPAND_SILU", EXPAND_SILU_DEFAULT))
        self.expand_silu = self.expand_silu_min is not None  # the activations are wired for it
        self._expand_silu_now = False  # this batch takes it

    def _uses_token_kernels(self, spec: LoRAModuleSpec) -> bool:
        # The token backend's launches (and its workspace) are prepared only for the split-K shrink;
        # the expand stays the chunked one (_expand_unfolded below).
        return self.split_shrink_max is not None

    def fill_batch_info(self, forward_batch: "ForwardBatch", weight_indices: list[int], lora_ranks: list[int],
                        scalings: list[float], path: ForwardPath) -> None:
        super().fill_batch_info(forward_batch, weight_indices, lora_ranks, scalings, path)
        bound = self.afold_prefill_max
        self._afold_prefill_now = (bound is not None and forward_batch.forward_mode.is_extend()
                                   and self.prefill_bucket(forward_batch.num_tokens) <= bound)
        bound = self.afold_qkv_max
        self._afold_qkv_now = (bound is not None and forward_batch.forward_mode.is_extend()
                               and self.prefill_bucket(forward_batch.num_tokens) <= bound)
        bound = self.split_shrink_max
        rows = forward_batch.num_tokens
        self._split_shrink_now = bound is not None and (
            self.prefill_bucket(rows) <= bound if forward_batch.forward_mode.is_extend()
            else self._bucket_within(rows, bound))
        bound = self.expand_silu_min
        self._expand_silu_now = bound is not None and (
            bound == 0 or (forward_batch.forward_mode.is_extend() and self.prefill_bucket(rows) >= bound))
        rule = self.prefill_unfold
        self._unfold_now = (rule is not None and forward_batch.forward_mode.is_extend()
                            and self.prefill_bucket(forward_batch.num_tokens) >= rule.min_tokens)

    def _runs_folded(self, spec: LoRAModuleSpec) -> bool:
        if not spec.folded:
            return False
        return not (self._unfold_now and spec.extra_cols > self.prefill_unfold.min_cols)

    # ---- A-folded modules past the deferral's bound (SGLANG_LORA_AFOLD_EXPAND) ----------------
    def expands_a_folded(self, weights: LoRAModuleWeights) -> bool:
        info = self.batch_info
        if weights.a_folded is None or info is None or info.defer:
            return False
        if weights.spec.stack > 1:  # qkv_proj: prefills only (decode keeps the fused norm)
            return self._afold_qkv_now
        if not self.afold_expand:
            return False
        # Decode batches carry row slots (the fused norms'); prefills only with SGLANG_LORA_AFOLD_PREFILL.
        return info.row_slots is not None or self._afold_prefill_now

    def run_a_folded(self, weights: LoRAModuleWeights, x: torch.Tensor) -> torch.Tensor:
        spec = weights.spec
        if spec.stack > 1:  # qkv_proj: B read in place inside W_aug, each slot's block of slices compact
            base, shrink = self._a_folded_gemm(weights, x)
            self._expand_unfolded(weights, shrink, base, x_slot_stride=spec.stack * spec.max_rank)
            return base
        base, delta = self.run_deferred(weights, x)
        # B transposed [S, R, N] read as [S, N, R]: a tile's output columns are contiguous.
        chunked_sgmv_lora_expand_forward(delta.shrink, delta.bt.transpose(1, 2), self.batch_info, base,
                                         num_slices=1, x_slot_stride=delta.max_rank, use_pdl=self.use_pdl)
        return base

    # ---- gate_up_proj's expand in the SiLU-and-mul (SGLANG_LORA_EXPAND_SILU) ----------------------
    def defers_expand(self, weights: LoRAModuleWeights) -> bool:
        info, spec = self.batch_info, weights.spec
        # Row-wise decode batches run the SiLU-and-mul with down_proj's shrink (run_act), which
        # reads gate_up's finished output: they keep the expand. Functions of the batch's mode and
        # bucket, so a graph and an eager pass decide alike.
        return (self._expand_silu_now and info is not None and not info.rowwise and spec.stack == 2
                and not spec.folded and info.num_rows > 0)

    def run_without_expand(self, weights: LoRAModuleWeights, base_layer: torch.nn.Module, x: torch.Tensor,
                           prepared: Optional[PreparedInput]) -> tuple[torch.Tensor, torch.Tensor]:
        if prepared is not None:  # the fused norm wrote the rows and their shrink
            assert prepared.xa is not None and prepared.x_aug is None, "an unfolded module's prepared input"
            return base_layer(prepared.normed), prepared.xa
        spec = weights.spec
        if x.stride(1) != 1 or x.stride(0) != spec.in_dim:
            x = x.contiguous()  # the launches were prepared for dense rows
        # Its own buffer, not the scratch: the activation may write down_proj's x_aug (the scratch)
        # while it reads xa.
        xa = torch.empty((x.shape[0], spec.stack * spec.max_rank), dtype=x.dtype, device=x.device)
        self._shrink_unfolded(weights, x, xa, self._launches[spec.name])
        return base_layer(x), xa

    def run_expand_act(self, weights: LoRAModuleWeights, xa: torch.Tensor, gate_up: torch.Tensor,
                       out: Optional[torch.Tensor]) -> torch.Tensor:
        rows, d = gate_up.shape[0], gate_up.shape[1] // 2
        if out is None:
            out = torch.empty((rows, d), dtype=gate_up.dtype, device=gate_up.device)
        else:  # down_proj's x_aug, in the scratch: xa must not be there (run_without_expand)
            assert out.untyped_storage().data_ptr() != xa.untyped_storage().data_ptr(), \
                "the activation would overwrite the shrink it reads"
        return segmented_expand_silu(xa, weights.B, self.batch_info, gate_up, out)

    # ---- unfolded modules --------------------------------------------------------------------
    def _add_unfolded(self, weights: LoRAModuleWeights, x: torch.Tensor, out: torch.Tensor,
                      launches: _ModuleLaunches) -> None:
        spec = weights.spec
        xa = self._scratch.matrix(x.shape[0], spec.stack * spec.max_rank)
        self._shrink_unfolded(weights, x, xa, launches)
        self._expand_unfolded(weights, xa, out, launches)

    def _shrink_unfolded(self, weights: LoRAModuleWeights, x: torch.Tensor, xa: torch.Tensor,
                         launches: _ModuleLaunches) -> None:
        """xa <- each row's compact, unscaled x @ A^T."""
        spec, info = weights.spec, self.batch_info
        # A folded module run apart at prefill (SGLANG_LORA_PREFILL_UNFOLD) has its pack launches,
        # not the token shrink's: it keeps the chunked shrink.
        if self._split_shrink_now and not spec.folded:
            assert launches.shrink is not None, "the split-K shrink is prepared whenever it may be taken"
            scratch = self._scratch
            launches.shrink(x, weights.A, xa, scratch.workspace, scratch.counters, info.permutation,
                            info.seg_indptr, info.weight_indices, info.lora_ranks)
        else:
            # One program per chunk reduces all of K (no split, no atomics, no memset).
            chunked_sgmv_lora_shrink_forward(x, weights.A, info, num_slices=spec.stack, out=xa)

    def _expand_unfolded(self, weights: LoRAModuleWeights, xa: torch.Tensor, out: torch.Tensor,
                         launches: Optional[_ModuleLaunches] = None, x_slot_stride: int = 0) -> None:
        """out += each row's delta from xa: the compact shrink of its own slot, or (`x_slot_stride`)
        every slot's, slot s's block at s * x_slot_stride (an A-folded qkv_proj's GEMM output)."""
        spec, info = weights.spec, self.batch_info
        offsets = self._slice_offsets.get(spec.name)
        b, slice_stride = weights.B, 0
        if spec.folded:  # run apart at prefill, or A-folded: B read in place inside W_aug
            b, slice_stride = folded_b(weights.folded, spec.in_dim, spec.stack, spec.max_rank,
                                       weights.B.shape[0])
        chunked_sgmv_lora_expand_forward(
            xa, b, info, out, num_slices=spec.stack, slice_offsets=offsets,
            max_slice_size=max(spec.slice_sizes) if offsets is not None else None, slice_stride=slice_stride,
            x_slot_stride=x_slot_stride, use_pdl=self.use_pdl,
        )


def split_shrink_bound(value: str) -> Optional[int]:
    """SGLANG_LORA_CSGMV_SPLIT_SHRINK: "0" never (None), "1" every batch, "tokens:T" batches whose
    graph bucket holds at most T tokens (T > 0)."""
    return token_bound(value, "SGLANG_LORA_CSGMV_SPLIT_SHRINK", every=1 << 30)


def afold_qkv_bound(value: str) -> Optional[int]:
    """SGLANG_LORA_AFOLD_QKV: "0" never (None), "1" every prefill, "tokens:T" prefills whose graph
    bucket holds at most T tokens (T > 0)."""
    return token_bound(value, "SGLANG_LORA_AFOLD_QKV", every=1 << 30)


def expand_silu_bound(value: str) -> Optional[int]:
    """SGLANG_LORA_EXPAND_SILU: "0" never (None), "1" every batch (0), "tokens:T" prefills whose
    graph bucket holds at least T tokens (T > 0; decode batches never)."""
    return token_bound(value, "SGLANG_LORA_EXPAND_SILU", every=0)


@dataclass(frozen=True)
class PrefillUnfold:
    """Folded modules with more than `min_cols` extra columns run apart at prefills whose bucket
    holds at least `min_tokens` tokens."""

    min_cols: int = -1
    min_tokens: int = 0


def parse_prefill_unfold(value: str) -> Optional[PrefillUnfold]:
    """SGLANG_LORA_PREFILL_UNFOLD: "0" never (None), "1" every folded module at every prefill,
    "cols:N", "tokens:T" or both joined by a comma."""
    if value in ("0", "1"):
        return None if value == "0" else PrefillUnfold()
    fields = {}
    for part in value.split(","):
        key, _, number = part.partition(":")
        if key not in ("cols", "tokens") or key in fields or not number.isdigit():
            raise ValueError(f"SGLANG_LORA_PREFILL_UNFOLD={value!r}: use 0, 1, cols:N, tokens:T or "
                             "cols:N,tokens:T (N, T >= 0)")
        fields[key] = int(number)
    return PrefillUnfold(min_cols=fields.get("cols", -1), min_tokens=fields.get("tokens", 0))
