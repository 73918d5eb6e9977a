"""The LoRA kernel designs that bench_lora_kernels.py compares, behind one small interface.

Each variant owns its metadata and scratch buffers for one case (a batch of `rows` token rows) and
runs the LoRA work of one decoder layer, module by module, adding into the base outputs in place:

  triton     today's `triton` backend: one segment per request (graph: 32 static segment slots)
  csgmv      today's `csgmv` backend: adapter-sorted 16-token chunks (graph: worst-case chunks)
  tok        token-major kernels (triton_ops/token_*.py): grid by rows only, split-K reduced by the
             last program of a tile (no memset kernel), launched through PreparedLaunch
  tok+pdl    the same, the expand launched as a programmatic dependent of the shrink (Hopper)
  dense      torch/cuBLAS only: one GEMM shrinks for every slot ([T, c*S*R]), one multiply keeps
             each token's own slot's columns (pre-scaled), one addmm per slice expands against
             every slot's B stacked [N_k, S*R] (reads all slots' B; needs all ranks = R)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from sglang.srt.lora.triton_ops.token_lora import (
    plan_expand,
    plan_shrink,
    prepare_expand,
    prepare_shrink,
    with_split,
)
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

MODULES = ("qkv", "o", "gate_up", "down")
PREFILL_MAX_BUCKET = 8192
DECODE_MAX_BS = 64


@dataclass(frozen=True)
class Shapes:
    hidden: int
    q: int
    kv: int
    inter: int

    def module(self, name: str) -> tuple[str, int, int, list[tuple[int, int]]]:
        """(input key, in_dim, stack c, output slices [(lo, hi)]) of a module."""
        h, q, kv, i = self.hidden, self.q, self.kv, self.inter
        return {
            "qkv": ("x", h, 3, [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]),
            "o": ("attn", q, 1, [(0, h)]),
            "gate_up": ("x", h, 2, [(0, i), (i, 2 * i)]),
            "down": ("act", i, 1, [(0, h)]),
        }[name]


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

    def token_slots(self) -> torch.Tensor:
        lens = self.lens if self.mode.is_extend() else [1] * len(self.lens)
        per_row = [s for n, s in zip(lens, self.slots) for _ in range(n)]
        return torch.tensor(per_row, dtype=torch.int32, device=self.device)

    def forward_batch(self, lens: Optional[list[int]] = None) -> ForwardBatch:
        lens = self.lens if lens is None else lens
        bs, extend = len(lens), self.mode.is_extend()
        num_tokens = sum(lens) if extend else bs
        t = torch.tensor(lens, dtype=torch.int64)
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
            extend_seq_lens_cpu=list(lens) if extend else None,
            extend_num_tokens=num_tokens if extend else None,
        )


class Variant:
    name = "?"
    launches_per_layer = 8

    def prepare(self, case: Case, graph: bool) -> None:
        raise NotImplementedError

    def module(self, name: str, io: dict, w: dict) -> None:
        raise NotImplementedError

    def layer(self, io: dict, w: dict) -> None:
        for m in MODULES:
            self.module(m, io, w)


class BackendVariant(Variant):
    """Today's backends through their public methods (what the LoRA layers call)."""

    def __init__(self, name: str, make: Callable, shapes: Shapes, num_slots: int, device: str) -> None:
        self.name, self.make, self.shapes, self.num_slots, self.device = name, make, shapes, num_slots, device
        self.backend = None
        self.offsets = torch.tensor([0, shapes.q, shapes.q + shapes.kv, shapes.q + 2 * shapes.kv],
                                    dtype=torch.int32, device=device)

    def prepare(self, case: Case, graph: bool) -> None:
        b = self.backend = self.make()
        zeros_r, zeros_s = [0] * self.num_slots, [0.0] * self.num_slots
        if not graph:
            b.prepare_lora_batch(case.forward_batch(), case.slots, case.ranks, case.scalings, use_cuda_graph=False)
            return
        # As the graph runners do: capture on a bucket of exactly these rows with all ranks 0,
        # then refresh in place with the live batch; a replay keeps the captured grid.
        rows = case.rows
        if case.mode.is_decode():
            b.init_cuda_graph_batch_info(DECODE_MAX_BS, 1)
            b.prepare_lora_batch(case.forward_batch([1] * rows), [0] * rows, zeros_r, zeros_s, True)
            frozen = (b.batch_info.bs, b.batch_info.max_len)
            b.prepare_lora_batch(case.forward_batch(), case.slots, case.ranks, case.scalings, True)
        else:
            b.init_prefill_cuda_graph_batch_info(PREFILL_MAX_BUCKET)
            b.prepare_lora_batch(case.forward_batch([rows]), [0], zeros_r, zeros_s, False, True)
            frozen = (b.batch_info.bs, b.batch_info.max_len)
            b.prepare_lora_batch(case.forward_batch(), case.slots, case.ranks, case.scalings, False, True)
        b.batch_info.bs, b.batch_info.max_len = frozen

    def module(self, name: str, io: dict, w: dict) -> None:
        b, s = self.backend, self.shapes
        if name == "qkv":
            b.run_qkv_lora(io["x"], w["qkv_a"], w["qkv_b"], self.offsets, max(s.q, s.kv), io["qkv"])
        elif name == "gate_up":
            b.run_gate_up_lora(io["x"], w["gate_up_a"], w["gate_up_b"], io["gate_up"])
        else:
            key = "attn" if name == "o" else "act"
            b.run_lora_b_sgemm(b.run_lora_a_sgemm(io[key], w[f"{name}_a"]), w[f"{name}_b"], io[name])


class TokenVariant(Variant):
    """Token-major kernels with every launch prepared once per batch (what a backend would keep)."""

    def __init__(
        self, shapes: Shapes, num_slots: int, max_rank: int, device: str, dtype, use_pdl: bool, bound: bool = True
    ) -> None:
        self.name = ("tok+pdl" if use_pdl else "tok") + ("" if bound else " (kernel[grid])")
        self.bound = bound  # False: every launch through triton's binder, for the host-time comparison
        self.split: Optional[int] = None  # force the shrink's K split (the benchmark's sweep)
        self.shapes, self.num_slots, self.max_rank = shapes, num_slots, max_rank
        self.device, self.dtype, self.use_pdl = device, dtype, use_pdl
        self.offsets = torch.tensor([0, shapes.q, shapes.q + shapes.kv, shapes.q + 2 * shapes.kv],
                                    dtype=torch.int32, device=device)

    def prepare(self, case: Case, graph: bool, w: Optional[dict] = None) -> None:
        # Graph or eager: the same launches (the grid depends on the rows only).
        rows, dev, R = case.rows, self.device, self.max_rank
        self.token_slots = case.token_slots()
        self.ranks = torch.tensor(case.ranks, dtype=torch.int32, device=dev)
        self.scalings = torch.tensor(case.scalings, dtype=torch.float32, device=dev)
        self.shrink, self.expand, self.xa = {}, {}, {}
        ws_numel = counters = 1
        elem = torch.tensor([], dtype=self.dtype).element_size()
        for m in MODULES:
            _, in_dim, c, slices = self.shapes.module(m)
            sp = plan_shrink(rows, in_dim, c * R, elem)
            if self.split is not None:
                sp = with_split(sp, self.split)
            ws_numel, counters = max(ws_numel, sp.workspace_numel), max(counters, sp.num_counters)
            self.xa[m] = torch.empty(rows, c * R, dtype=self.dtype, device=dev)
            x_like = torch.empty(0, in_dim, dtype=self.dtype, device=dev)
            a_like = torch.empty(self.num_slots, c * R, in_dim, dtype=self.dtype, device=dev)
            self.shrink[m] = prepare_shrink(sp, x_like, a_like, c * R, c, self.use_pdl)
            out_dim = slices[-1][1]
            widths = {hi - lo for lo, hi in slices}
            equal = len(widths) == 1
            ep = plan_expand(rows, out_dim, len(slices), R, None if equal else max(widths))
            b_like = torch.empty(self.num_slots, out_dim, R, dtype=self.dtype, device=dev)
            self.expand[m] = prepare_expand(ep, b_like, c * R, out_dim, not equal, self.use_pdl)
        self.workspace = torch.empty(ws_numel, dtype=torch.float32, device=dev)
        self.counters = torch.zeros(counters, dtype=torch.int32, device=dev)

    def module(self, name: str, io: dict, w: dict) -> None:
        key = self.shapes.module(name)[0]
        xa = self.xa[name]
        shrink, expand = self.shrink[name], self.expand[name]
        if not self.bound:
            shrink, expand = shrink.call_unbound, expand.call_unbound
        shrink(io[key], w[f"{name}_a"], xa, self.workspace, self.counters, self.token_slots, self.ranks)
        offsets = self.offsets if name == "qkv" else self.token_slots
        expand(xa, w[f"{name}_b"], io[name], self.token_slots, self.ranks, self.scalings, offsets)

    def module_with_base(self, name: str, io: dict, w: dict, base_w: dict, side: Optional[torch.cuda.Stream]) -> None:
        """Base GEMM + LoRA; with `side`, the shrink runs on it concurrently with the GEMM."""
        key = self.shapes.module(name)[0]
        xa = self.xa[name]
        shrink_args = (io[key], w[f"{name}_a"], xa, self.workspace, self.counters, self.token_slots, self.ranks)
        if side is None:
            torch.matmul(io[key], base_w[name].T, out=io[name])
            self.shrink[name](*shrink_args)
        else:
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                self.shrink[name](*shrink_args)
            torch.matmul(io[key], base_w[name].T, out=io[name])
            main.wait_stream(side)
        offsets = self.offsets if name == "qkv" else self.token_slots
        self.expand[name](xa, w[f"{name}_b"], io[name], self.token_slots, self.ranks, self.scalings, offsets)


class DenseVariant(Variant):
    """torch/cuBLAS only (see the module docstring). Weights are re-laid out once, outside timing."""

    name = "dense"

    def __init__(self, shapes: Shapes, num_slots: int, max_rank: int, device: str, dtype) -> None:
        self.shapes, self.num_slots, self.R, self.device, self.dtype = shapes, num_slots, max_rank, device, dtype
        self.launches_per_layer = sum(2 + len(shapes.module(m)[3]) for m in MODULES)

    def relayout(self, w: dict) -> None:
        S, R = self.num_slots, self.R
        self.a_cat, self.b_k = {}, {}
        for m in MODULES:
            _, in_dim, c, slices = self.shapes.module(m)
            a = w[f"{m}_a"].view(S, c, R, in_dim).permute(1, 0, 2, 3)  # slice-major
            self.a_cat[m] = a.reshape(c * S * R, in_dim).contiguous()
            b = w[f"{m}_b"]  # [S, out, R]
            self.b_k[m] = [b[:, lo:hi, :].permute(1, 0, 2).reshape(hi - lo, S * R).contiguous() for lo, hi in slices]

    def prepare(self, case: Case, graph: bool) -> None:
        assert all(r in (0, self.R) for r in case.ranks), "dense needs every adapter at the pool rank"
        S, R, rows = self.num_slots, self.R, case.rows
        own = torch.zeros(rows, S, dtype=torch.float32, device=self.device)
        slots = case.token_slots().long()
        scal = torch.tensor(case.scalings, dtype=torch.float32, device=self.device)
        own[torch.arange(rows, device=self.device), slots] = scal[slots]
        self.mask, self.xa = {}, {}
        for m in MODULES:
            c = self.shapes.module(m)[2]
            per_slice = own[:, None, :, None].expand(rows, c, S, R)
            self.mask[m] = per_slice.reshape(rows, c * S * R).to(self.dtype).contiguous()
            self.xa[m] = torch.empty(rows, c * S * R, dtype=self.dtype, device=self.device)

    def module(self, name: str, io: dict, w: dict) -> None:
        key, _, c, slices = self.shapes.module(name)
        xa, SR = self.xa[name], self.num_slots * self.R
        torch.matmul(io[key], self.a_cat[name].T, out=xa)
        xa.mul_(self.mask[name])
        out = io[name]
        for k, (lo, hi) in enumerate(slices):
            out[:, lo:hi].addmm_(xa[:, k * SR : (k + 1) * SR], self.b_k[name][k].T)


def reference_deltas(case: Case, shapes: Shapes, io: dict, w: dict) -> dict[str, torch.Tensor]:
    """fp32 LoRA deltas per module, token by token from the pool weights."""
    slots = case.token_slots().tolist()
    out = {}
    for m in MODULES:
        key, _, c, slices = shapes.module(m)
        x = io[key].float()
        delta = torch.zeros(case.rows, slices[-1][1], dtype=torch.float32, device=x.device)
        for s in sorted(set(slots)):
            r = case.ranks[s]
            if r == 0:
                continue
            rows = torch.tensor([i for i, t in enumerate(slots) if t == s], device=x.device)
            xa = x[rows] @ w[f"{m}_a"][s, : c * r].float().T
            for k, (lo, hi) in enumerate(slices):
                part = xa[:, k * r : (k + 1) * r] @ w[f"{m}_b"][s, lo:hi, :r].float().T
                delta[rows, lo:hi] = case.scalings[s] * part
        out[m] = delta
    return out
