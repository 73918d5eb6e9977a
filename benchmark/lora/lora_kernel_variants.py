"""The LoRA module designs that bench_lora_kernels.py compares: the engine's own backends, configured.

Every variant computes whole modules (base GEMM + LoRA) through `backend.run_module`, exactly as
the LoRA layers call it, for the four modules of one decoder layer; every kernel walks the batch's
adapter segments (lora/segments.py):

  csgmv/unfold  `csgmv` with no module folded: base GEMM, then the chunked SGMV shrink and expand
                (what csgmv runs for modules over the fold bound)
  tok           `triton` with no module folded: base GEMM, token-major shrink (split-K) and expand
                (on Hopper a programmatic dependent launch of the shrink); triton's unfolded path
  fold          `triton`, every module folded: shrink_pack writes [x | packed shrink], then ONE
                cuBLAS GEMM over W_aug = [W | block-diagonal B of every slot]
  auto          `triton` with lora/fold.py's rule per module (what `--lora-fold auto` picks)
  fold/k256w8   `fold` with token_lora's knobs changed: K split in pieces of 256 (K_PER_SPLIT), 8 warps
                (NUM_WARPS), K tiles of 128 (d128: K_DEPTH_16BIT)

LoRA cost = (variant's four modules) - (the four base GEMMs alone), so designs that fold LoRA into
the base GEMM and designs that add it afterwards compare on one scale.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.lora.backend.chunked_backend import ChunkedSgmvLoRABackend
from sglang.srt.lora.backend.token_backend import TokenLoRABackend
from sglang.srt.lora.fold import fold_extra_columns, fold_weight, should_fold
from sglang.srt.lora.triton_ops import token_lora
from sglang.srt.lora.utils import LoRAModuleSpec, LoRAModuleWeights
from sglang.srt.configs.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.configs.forward_path import ForwardPath

MODULES = ("qkv", "o", "gate_up", "down")


@dataclass(frozen=True)
class Shapes:
    hidden: int
    q: int
    kv: int
    inter: int

    def module(self, name: str) -> tuple[str, int, tuple[int, ...]]:
        """(input key, in_dim, output slice widths) of a module."""
        h, q, kv, i = self.hidden, self.q, self.kv, self.inter
        return {"qkv": ("x", h, (q, kv, kv)), "o": ("attn", q, (h,)), "gate_up": ("x", h, (i, i)),
                "down": ("act", i, (h,))}[name]


@dataclass
class Case:
    """One batch: per-request token counts and slots; slot 0 is the base model (rank 0)."""

    lens: list[int]
    slots: list[int]
    mode: ForwardMode
    ranks: list[int]  # per pool slot
    scalings: list[float]
    device: str

    @property
    def rows(self) -> int:
        return sum(self.lens) if self.mode.is_extend() else len(self.lens)

    def row_slots(self) -> list[int]:
        lens = self.lens if self.mode.is_extend() else [1] * len(self.lens)
        return [s for n, s in zip(lens, self.slots) for _ in range(n)]

    def forward_batch(self) -> ForwardBatch:
        bs, extend = len(self.lens), self.mode.is_extend()
        num_tokens = self.rows
        t = torch.tensor(self.lens, dtype=torch.int64)
        dev = self.device
        return ForwardBatch(
            forward_mode=self.mode,
            batch_size=bs,
            input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=dev),
            positions=torch.zeros(num_tokens, dtype=torch.int64, device=dev),
            out_cache_loc=torch.zeros(num_tokens, dtype=torch.int64, device=dev),
            req_pool_indices=torch.arange(bs, device=dev),
            seq_lens=t.to(dev),
            seq_lens_cpu=t,
            extend_seq_lens=t.to(dev) if extend else None,
            extend_seq_lens_cpu=list(self.lens) if extend else None,
            extend_num_tokens=num_tokens if extend else None,
        )


class _Linear(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class LayerWeights:
    """One decoder layer: base weights W, pool-shaped adapters (A [S, c*R, in], B [S, out, R], every
    adapter at rank R), and, made on first use, each module's W_aug with B folded in."""

    def __init__(self, shapes: Shapes, num_slots: int, max_rank: int, dtype, device, gen) -> None:
        self.shapes, self.num_slots, self.max_rank = shapes, num_slots, max_rank
        self.w, self.a, self.b = {}, {}, {}
        for m in MODULES:
            _, in_dim, slices = shapes.module(m)
            out = sum(slices)
            self.w[m] = (torch.randn(out, in_dim, generator=gen, device=device) / in_dim**0.5).to(dtype)
            self.a[m] = (torch.randn(num_slots, len(slices) * max_rank, in_dim, generator=gen, device=device)
                         / in_dim**0.5).to(dtype)
            self.b[m] = (torch.randn(num_slots, out, max_rank, generator=gen, device=device) / max_rank**0.5).to(dtype)
        self._folded: dict[str, tuple[torch.Tensor, object]] = {}

    def spec(self, m: str, folded: bool) -> LoRAModuleSpec:
        _, in_dim, slices = self.shapes.module(m)
        extra = fold_extra_columns(self.num_slots, len(slices), self.max_rank) if folded else 0
        return LoRAModuleSpec(m, in_dim, slices, self.max_rank, extra)

    def folded(self, m: str) -> tuple[torch.Tensor, object]:
        if m not in self._folded:
            w_aug, sliced = fold_weight(self.w[m], self.shapes.module(m)[2], self.num_slots, self.max_rank)
            for slot in range(self.num_slots):
                sliced[slot].copy_(self.b[m][slot])
            self._folded[m] = (w_aug, sliced)
        return self._folded[m]

    def module(self, m: str, folded: bool) -> tuple[LoRAModuleWeights, nn.Module]:
        if not folded:
            return LoRAModuleWeights(self.spec(m, False), self.a[m], self.b[m], None), _Linear(self.w[m])
        w_aug, sliced = self.folded(m)
        in_dim = self.shapes.module(m)[1]
        return LoRAModuleWeights(self.spec(m, True), self.a[m], sliced, None, w_aug), _Linear(w_aug[:, :in_dim])

    def auto_folds(self, m: str) -> bool:
        _, _, slices = self.shapes.module(m)
        extra = fold_extra_columns(self.num_slots, len(slices), self.max_rank)
        return should_fold(sum(slices), extra, self.w[m].element_size())


_TUNABLES = {"k": "K_PER_SPLIT", "w": "NUM_WARPS", "d": "K_DEPTH_16BIT"}
_CACHED = ("plan_shrink", "plan_pack", "plan_expand", "_bound_shrink", "_bound_pack", "_bound_expand")


def parse_tuning(spec: Optional[str]) -> dict[str, int]:
    """'k256w8d128' -> {K_PER_SPLIT: 256, NUM_WARPS: 8, K_DEPTH_16BIT: 128} (token_lora's knobs)."""
    if not spec:
        return {}
    found = re.findall(r"([kwd])(\d+)", spec)
    assert found and "".join(a + b for a, b in found) == spec, f"bad tuning {spec!r}: use e.g. k256w8d128"
    return {_TUNABLES[a]: int(b) for a, b in found}


@contextlib.contextmanager
def tuning(spec: Optional[str]):
    """Plans and bound kernels made inside use token_lora's knobs set by `spec` (None: the engine's)."""
    values = parse_tuning(spec)
    saved = {name: getattr(token_lora, name) for name in values}

    def apply(vals):
        for name, v in vals.items():
            setattr(token_lora, name, v)
        for fn in _CACHED:
            getattr(token_lora, fn).cache_clear()

    if not values:
        yield
        return
    apply(values)
    try:
        yield
    finally:
        apply(saved)


class BackendVariant:
    """A backend with every module of one layer registered, in one fold mode ("on", "off", "auto")."""

    def __init__(self, name: str, backend_cls, fold: str, use_pdl: bool, weights: LayerWeights,
                 tuning: Optional[str] = None) -> None:
        self.name, self.backend_cls, self.fold_mode, self.use_pdl, self.weights = name, backend_cls, fold, use_pdl, weights
        self.tuning = tuning
        self.backend = None

    def folds(self, m: str) -> bool:
        return self.fold_mode == "on" or (self.fold_mode == "auto" and self.weights.auto_folds(m))

    @property
    def lora_launches_per_layer(self) -> int:
        return sum(1 if self.folds(m) else 2 for m in MODULES)

    def prepare(self, case: Case, graph: bool) -> None:
        """A fresh backend with this batch's metadata (graph: in the static buffers, sized for
        exactly these rows, as a graph runner's bucket would be)."""
        w = self.weights
        dev = case.device
        b = self.backend = self.backend_cls(w.num_slots, dev, use_pdl=self.use_pdl)
        self.layer_modules = {m: w.module(m, self.folds(m)) for m in MODULES}
        b.init_modules({m: lw.spec for m, (lw, _) in self.layer_modules.items()},
                       torch.tensor(case.ranks, dtype=torch.int32, device=dev),
                       torch.tensor(case.scalings, dtype=torch.float32, device=dev), w.w["qkv"].dtype)
        decode = case.mode.is_decode()
        with tuning(self.tuning):  # scratch sizes, launch plans and bound kernels are made here
            if graph and decode:
                b.init_cuda_graph_batch_info(case.rows, 1)
            elif graph:
                b.init_prefill_cuda_graph_batch_info(case.rows)
            path = (ForwardPath.DECODE_GRAPH if decode else ForwardPath.PREFILL_GRAPH) if graph else ForwardPath.EAGER
            b.fill_batch_info(case.forward_batch(), case.slots, case.ranks, case.scalings, path)

    def module(self, name: str, io: dict) -> torch.Tensor:
        lw, base = self.layer_modules[name]
        return self.backend.run_module(lw, base, io[self.weights.shapes.module(name)[0]])

    def layer(self, io: dict) -> dict[str, torch.Tensor]:
        return {m: self.module(m, io) for m in MODULES}


def make_variants(weights: LayerWeights, device: str, pdl: bool, tunings=()) -> list[BackendVariant]:
    variants = [
        BackendVariant("csgmv/unfold", ChunkedSgmvLoRABackend, "off", pdl, weights),
        BackendVariant("tok", TokenLoRABackend, "off", pdl, weights),
        BackendVariant("fold", TokenLoRABackend, "on", pdl, weights),
        BackendVariant("auto", TokenLoRABackend, "auto", pdl, weights),
    ]
    variants += [BackendVariant(f"fold/{t}", TokenLoRABackend, "on", pdl, weights, t) for t in tunings]
    return variants


def base_gemms(weights: LayerWeights, io: dict, strided: bool = False, only: Optional[str] = None
               ) -> dict[str, torch.Tensor]:
    """The four base GEMMs alone (or module `only`); `strided`: through W_aug[:, :K] (a LoRA
    server's all-base batch)."""
    out = {}
    for m in MODULES if only is None else (only,):
        key, in_dim, _ = weights.shapes.module(m)
        w = weights.folded(m)[0][:, :in_dim] if strided else weights.w[m]
        out[m] = F.linear(io[key], w)
    return out


def reference_deltas(case: Case, weights: LayerWeights, io: dict) -> dict[str, torch.Tensor]:
    """fp32 LoRA deltas per module, slot by slot from the pool weights."""
    slots = case.row_slots()
    out = {}
    for m in MODULES:
        key, _, slices = weights.shapes.module(m)
        x = io[key].float()
        c = len(slices)
        delta = torch.zeros(case.rows, sum(slices), dtype=torch.float32, device=x.device)
        for s in sorted(set(slots)):
            r = case.ranks[s]
            if r == 0:
                continue
            rows = torch.tensor([i for i, t in enumerate(slots) if t == s], device=x.device)
            xa = x[rows] @ weights.a[m][s, : c * r].float().T
            lo = 0
            for k, width in enumerate(slices):
                part = xa[:, k * r : (k + 1) * r] @ weights.b[m][s, lo : lo + width, :r].float().T
                delta[rows, lo : lo + width] = case.scalings[s] * part
                lo += width
        out[m] = delta
    return out


def relative_error(got: dict, base: dict, ref: dict) -> float:
    """Worst relative Frobenius error of the deltas (output - base) against the fp32 reference."""
    worst = 0.0
    for m in MODULES:
        delta = got[m].float() - base[m].float()
        if not torch.isfinite(delta).all():
            return float("inf")
        worst = max(worst, ((delta - ref[m]).norm() / ref[m].norm().clamp_min(1e-30)).item())
    return worst


def host_layer_launches(variant: Optional[BackendVariant]) -> int:
    """Launches per layer: LoRA kernels plus the module GEMMs (4)."""
    return 4 + (variant.lora_launches_per_layer if variant is not None else 0)
