"""LoRA's decode kernels before the folded GEMMs: do the row-wise kernels pay (`--lora-fuse-norm`)?

    PYTHONPATH=$PWD/python python benchmark/lora/bench_norm_shrink.py [--models qwen3-4b llama-3.1-8b]
        [--decode-bs 1 8 32 64 128] [--adapters 8] [--rank 16] [--out f.md]
    PYTHONPATH=$PWD/python python benchmark/lora/bench_norm_shrink.py --cpu-dry-run   # tiny, interpreter

One decode step's worth of the four folded modules, every layer its own weights (so nothing stays
in L2 that would not in a model): per layer qkv_proj and gate_up_proj (each after its RMSNorm,
residual add fused), o_proj, and down_proj after SiLU-and-mul. Variants:
  base     the norms, F.linear(x, W)                              (no LoRA)
  unfused  the norms, shrink_pack before every module (segments, split-K, PDL where the GPU has
           it), F.linear(x_aug, W_aug)                            (what serves today)
  fused    norm_shrink_pack for qkv / gate_up, shrink_pack for o / down  (--lora-fuse-norm)
  rowwise  fused, o_proj's shrink_pack replaced by the row-wise kernel without a norm, and
           down_proj's SiLU-and-mul + shrink_pack by the row-wise kernel with SiLU-and-mul
           (SGLANG_LORA_ROWWISE_DECODE=1)
  afold_expand  fused, o_proj / down_proj as one GEMM over [W; A] and the segmented expand
           (SGLANG_LORA_AFOLD_EXPAND=1); with --afold also `afold` (the delta in the next norm)
captured as one CUDA graph per variant and replayed; GPU µs per step, and per module saved against
`unfused`. The rows take the batch's adapters in turn (8 adapters in 9 slots, the serving
default). Every LoRA variant's outputs are compared with `unfused`'s first (max |diff| of the GEMM
outputs relative to their scale).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "python"))
sys.path.insert(0, str(HERE.parent))  # benchmark/: bench_util
if "--cpu-dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench_util import add_output_args, emit_table, graph_us, model_dims, module_knobs, target  # noqa: E402
from sglang.srt.layers.triton_ops.rmsnorm import rmsnorm_fwd  # noqa: E402
from sglang.srt.lora.fold import fold_extra_columns  # noqa: E402
from sglang.srt.lora.triton_ops import chunked_sgmv_lora_expand_forward  # noqa: E402
from sglang.srt.lora.utils import LoRABatchInfo  # noqa: E402
from sglang.srt.layers.triton_ops.silu_and_mul import silu_and_mul_fwd  # noqa: E402
from sglang.srt.lora.triton_ops import norm_shrink_pack as nsp  # noqa: E402
from sglang.srt.lora.triton_ops.norm_shrink_pack import norm_shrink_pack, silu_shrink_pack  # noqa: E402
from sglang.srt.layers.triton_ops import common  # noqa: E402
from sglang.srt.lora.triton_ops.token_lora import pdl_available, plan_pack, prepare_pack, token_segments  # noqa: E402

EPS = 1e-6


class Module:
    """One folded module of one layer: its norm weight (None: no norm before it), A [S, c*R, K],
    W_aug [N, K + E], W = W_aug[:, :K]."""

    def __init__(self, in_dim: int, out_dim: int, stack: int, slots: int, rank: int, dtype, device, gen,
                 norm: bool, act: bool = False) -> None:
        # act: the input is SiLU-and-mul of a [gate | up] row (down_proj).
        self.in_dim, self.stack, self.rank, self.norm, self.act = in_dim, stack, rank, norm, act
        self.extra = fold_extra_columns(slots, stack, rank)
        self.norm_w = (1 + 0.1 * torch.randn(in_dim, generator=gen)).to(dtype).to(device)
        self.a = (torch.randn(slots, stack * rank, in_dim, generator=gen) / in_dim**0.5).to(dtype).to(device)
        self.w_aug = (torch.randn(out_dim, in_dim + self.extra, generator=gen) / in_dim**0.5).to(dtype).to(device)
        self.w = self.w_aug[:, :in_dim]
        if stack == 1 and not norm:
            # `afold` (o_proj, down_proj): W_a = [W; A of every slot] (the GEMM also writes every
            # slot's shrink), B transposed [S, R, N] for the norm after it.
            self.w_a = torch.cat([self.w, self.a.reshape(slots * rank, in_dim)]).contiguous()
            # The same B as W_aug's blocks (slot s at columns K + s*R), transposed [S, R, N].
            blocks = self.w_aug[:, in_dim : in_dim + slots * rank].reshape(out_dim, slots, rank)
            self.bt = blocks.permute(1, 2, 0).contiguous()


def build(shape: str, rank: int, slots: int, dtype, device) -> list[Module]:
    hidden, q, kv, inter, _, layers = model_dims(shape)
    gen = torch.Generator().manual_seed(0)
    mods = []
    for _ in range(layers):
        mods.append(Module(hidden, q + 2 * kv, 3, slots, rank, dtype, device, gen, norm=True))  # qkv_proj
        mods.append(Module(q, hidden, 1, slots, rank, dtype, device, gen, norm=False))  # o_proj
        mods.append(Module(hidden, 2 * inter, 2, slots, rank, dtype, device, gen, norm=True))  # gate_up_proj
        mods.append(Module(inter, hidden, 1, slots, rank, dtype, device, gen, norm=False, act=True))  # down_proj
    return mods


class Step:
    """The variants over one batch: inputs, per-module scratch and prepared launches."""

    def __init__(self, mods: list[Module], bs: int, adapters: int, slots: int, dtype, device) -> None:
        self.mods, self.bs = mods, bs
        gen = torch.Generator().manual_seed(bs)
        # Each module's input (the hidden state before a norm; the attention or MLP activation else).
        self.x = {m.in_dim: torch.randn(bs, m.in_dim, generator=gen).to(dtype).to(device) for m in mods}
        inter = next(m.in_dim for m in mods if m.act)
        self.gate_up = torch.randn(bs, 2 * inter, generator=gen).to(dtype).to(device)
        hidden = mods[0].in_dim
        self.residual = torch.randn(bs, hidden, generator=gen).to(dtype).to(device)
        self.res_work = torch.empty_like(self.residual)
        self.res_out = torch.empty_like(self.residual)
        self.normed = torch.empty_like(self.residual)
        ranks = [0] + [mods[0].rank] * (slots - 1)  # slot 0: the base model
        self.ranks = torch.tensor(ranks, dtype=torch.int32, device=device)
        self.scalings = torch.tensor([0.0] + [2.0] * (slots - 1), dtype=torch.float32, device=device)
        self.row_slots = torch.tensor([1 + i % adapters for i in range(bs)], dtype=torch.int32, device=device)
        perm, indptr, seg_slots, n_segs = token_segments(self.row_slots.cpu(), self.ranks.cpu(), 16)
        self.segments = (perm.to(device), indptr.to(device), seg_slots.to(device))
        # The same segments as csgmv's expand reads them (`afold_expand`).
        self.info = LoRABatchInfo(bs, self.ranks, self.scalings, bs=n_segs, num_segments=n_segs, max_len=16,
                                  seg_indptr=self.segments[1], weight_indices=self.segments[2],
                                  permutation=self.segments[0])
        use_pdl = self.use_pdl = pdl_available(torch.device(device))
        self.launches, self.x_aug, self.scratch = [], [], []
        for m in mods:
            plan = plan_pack(m.in_dim, m.stack, m.rank, m.extra, self.residual.element_size())
            width = m.in_dim + m.extra
            self.x_aug.append(torch.empty(bs, width, dtype=dtype, device=device))
            workspace = torch.empty(max(plan.shrink.workspace_numel(bs), 1), dtype=torch.float32, device=device)
            counters = torch.zeros(max(plan.shrink.num_counters(n_segs), 1), dtype=torch.int32, device=device)
            self.scratch.append((workspace, counters))
            self.launches.append(prepare_pack(plan, bs, n_segs, self.x[m.in_dim], m.a, width, use_pdl))
        self.outs: list[torch.Tensor] = []

    def _input(self, m: Module) -> torch.Tensor:
        """The module's x: the norm's output (residual add fused), SiLU-and-mul's, or its own."""
        if m.act:
            return silu_and_mul_fwd(self.gate_up)
        if not m.norm:
            return self.x[m.in_dim]
        return rmsnorm_fwd(self.x[m.in_dim], m.norm_w, EPS, residual=self.res_work, out=self.normed)

    def _segmented(self, i: int, m: Module, x: torch.Tensor) -> None:
        workspace, counters = self.scratch[i]
        self.launches[i](x, m.a, self.x_aug[i], workspace, counters, *self.segments, self.ranks, self.scalings)

    def _rowwise(self, i: int, m: Module) -> None:
        """The row-wise kernels: with the module's norm, with down_proj's SiLU-and-mul, or (o_proj)
        the row-wise pack alone."""
        x = self.x[m.in_dim]
        if m.act:
            silu_shrink_pack(self.gate_up, m.a, self.x_aug[i], self.row_slots, self.ranks, self.scalings, m.rank,
                             use_pdl=self.use_pdl)
        elif m.norm:
            # The new residual to its own buffer (ping-pong), as the fused engine does.
            new = norm_shrink_pack(x, self.res_work, m.norm_w, EPS, m.a, self.x_aug[i], self.row_slots, self.ranks,
                                   self.scalings, m.stack, m.rank, residual_out=self.res_out, use_pdl=self.use_pdl)
            self.res_work, self.res_out = new, self.res_work
        else:
            norm_shrink_pack(x, None, None, EPS, m.a, self.x_aug[i], self.row_slots, self.ranks, self.scalings,
                             m.stack, m.rank, use_pdl=self.use_pdl)

    def base(self) -> None:
        self.outs = []
        self.res_work.copy_(self.residual)
        for m in self.mods:
            self.outs.append(F.linear(self._input(m), m.w))

    def _lora(self, rowwise: Callable[[Module], bool]) -> None:
        """Every module folded, its input and shrink written row-wise where `rowwise(m)`."""
        self.outs = []
        self.res_work.copy_(self.residual)
        for i, m in enumerate(self.mods):
            if rowwise(m):
                self._rowwise(i, m)
            else:
                self._segmented(i, m, self._input(m))
            self.outs.append(F.linear(self.x_aug[i], m.w_aug))

    def unfused(self) -> None:
        self._lora(lambda m: False)

    def afold_expand(self) -> None:
        """Past the A-fold's deferral bound (SGLANG_LORA_AFOLD_EXPAND=1, csgmv): the norms fused as in
        `fused`; o_proj and down_proj run their GEMM over W_a and the segmented expand of every slot's
        shrink into the base columns (B transposed, x_slot_stride = R). The same outputs as `unfused`."""
        self.outs = []
        self.res_work.copy_(self.residual)
        for i, m in enumerate(self.mods):
            if m.norm:
                self._rowwise(i, m)
                self.outs.append(F.linear(self.x_aug[i], m.w_aug))
                continue
            n = m.w.shape[0]
            out = F.linear(self._input(m), m.w_a)
            chunked_sgmv_lora_expand_forward(out[:, n:], m.bt.transpose(1, 2), self.info, out[:, :n], 1,
                                             x_slot_stride=m.rank)
            self.outs.append(out[:, :n])

    def afold(self) -> None:
        """o_proj and down_proj A-folded: their GEMM over W_a writes [base output | every slot's
        shrink], and the next norm (fused with its module's shrink) adds the row's delta before the
        residual. No LoRA launch of their own; SiLU-and-mul is the base's kernel. The first qkv
        norm of the step has no delta before it."""
        self.outs = []
        self.res_work.copy_(self.residual)
        pending = None  # (GEMM output [T, N + S*R], its module)
        for i, m in enumerate(self.mods):
            if m.norm:
                x, delta = self.x[m.in_dim], None
                if pending is not None:
                    out, pm = pending
                    x = out[:, : m.in_dim]
                    delta = nsp.DeferredDelta(out[:, m.in_dim :], pm.bt, self.scalings, pm.rank)
                new = norm_shrink_pack(x, self.res_work, m.norm_w, EPS, m.a, self.x_aug[i], self.row_slots,
                                       self.ranks, self.scalings, m.stack, m.rank, residual_out=self.res_out,
                                       use_pdl=self.use_pdl, delta=delta)
                self.res_work, self.res_out = new, self.res_work
                self.outs.append(F.linear(self.x_aug[i], m.w_aug))
            else:
                x = silu_and_mul_fwd(self.gate_up) if m.act else self.x[m.in_dim]
                out = F.linear(x, m.w_a)
                pending = (out, m)
                self.outs.append(out)

    def fused(self) -> None:  # --lora-fuse-norm
        self._lora(lambda m: m.norm)

    def rowwise(self) -> None:  # and SGLANG_LORA_ROWWISE_DECODE=1
        self._lora(lambda m: True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["qwen3-4b", "llama-3.1-8b"])
    p.add_argument("--decode-bs", nargs="+", type=int, default=[1, 8, 32, 64, 128])
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--early-start", action="store_true",
                   help="also time `fused` with the early-start knobs changed: norm_shrink_pack as a PDL dependent "
                        "(up to norm_shrink_pack.PDL_MAX_ROWS rows), SiLU-and-mul releasing its dependents at its "
                        "start (common.RELEASE_DEPENDENTS)")
    p.add_argument("--tile-elements", nargs="*", type=int, default=[],
                   help="also time `fused` with norm_shrink_pack.TILE_ELEMENTS set to each (its column tile: "
                        "fewer, wider programs per row re-normalise the row fewer times)")
    p.add_argument("--early-loads", action="store_true",
                   help="also time `base`, `fused` and `rowwise` with norm_shrink_pack.EARLY_LOADS (the loads that need "
                        "only the slot go out with the row) and rmsnorm.WEIGHT_FIRST (the norm's weight with the row), "
                        "and `fused` with NORM_WEIGHT_EARLY as well")
    p.add_argument("--afold", action="store_true",
                   help="also time `afold`: o_proj / down_proj A-folded, their deltas added by the next norm")
    add_output_args(p)
    args = p.parse_args()
    dry, device, dtype, models = target(args)
    bss = [1, 3] if dry else args.decode_bs
    slots = args.adapters + 1
    lines, tiles, early, afolds, loads = [], [], [], [], []
    for shape in models:
        mods = build(shape, args.rank, slots, dtype, device)
        layers = model_dims(shape)[5]
        title = (f"### {shape}: the four folded modules, {layers} layers, {args.adapters} rank-{args.rank} "
                 f"adapters in {slots} slots ({'CPU dry run' if dry else torch.cuda.get_device_name(0)})")
        lines += [title, "", "| decode bs | base µs/step | unfused | fused | rowwise | LoRA unfused | LoRA fused | "
                  "LoRA rowwise | fused saves µs/norm-fed module | rowwise saves µs/module | max rel diff |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for bs in bss:
            step = Step(mods, bs, args.adapters, slots, dtype, device)
            step.unfused()
            ref = [o.float().clone() for o in step.outs]
            diff = 0.0
            for variant in (step.fused, step.rowwise, step.afold_expand):
                variant()
                diff = max(diff, max(float((o.float() - r).abs().max() / r.abs().max().clamp_min(1e-6))
                                     for o, r in zip(step.outs, ref)))
            if dry:
                lines.append(f"| {bs} | - | - | - | - | - | - | - | - | - | {diff:.1e} |")
                base = float("nan")
            else:
                base, unfused, fused, rowwise = (graph_us(lambda _, f=f: f()) for f in
                                                 (step.base, step.unfused, step.fused, step.rowwise))
                n = len(mods)
                lines.append(f"| {bs} | {base:.0f} | {unfused:.0f} | {fused:.0f} | {rowwise:.0f} | "
                             f"{unfused - base:.0f} | {fused - base:.0f} | {rowwise - base:.0f} | "
                             f"{2 * (unfused - fused) / n:.2f} | {(unfused - rowwise) / n:.2f} | {diff:.1e} |")
                print(lines[-1], flush=True)
            if args.afold:
                step.afold()  # compiles; its outputs are not `unfused`'s (the deltas move to the next norm)
                if not dry:
                    us = graph_us(lambda _: step.afold())
                    expand_us = graph_us(lambda _: step.afold_expand())
                    best = min(fused, rowwise)
                    afolds.append(f"| {shape} | {bs} | {base:.0f} | {fused - base:.0f} | {rowwise - base:.0f} | "
                                  f"{us - base:.0f} | {expand_us - base:.0f} | "
                                  f"{(us - base) / max(best - base, 1e-9):.2f} | {us / base:.3f} | {best / base:.3f} |")
                    print(afolds[-1], flush=True)
            if args.early_start:
                early += early_start_rows(shape, step, dry)
            if args.early_loads:
                loads.append(early_loads_row(shape, step, dry))
            for tile in args.tile_elements:
                us, tile_diff = fused_with_tile(step, tile, ref, dry)
                tiles.append(f"| {shape} | {bs} | {tile} | {us:.0f} | {us - base:.0f} | {tile_diff:.1e} |")
        lines.append("")
    if args.tile_elements:
        lines += table_section(f"`fused` with other column tiles (default TILE_ELEMENTS {nsp.TILE_ELEMENTS})",
                               ["model", "decode bs", "TILE_ELEMENTS", "fused µs/step", "LoRA fused", "max rel diff"],
                               tiles)
    if args.afold:
        lines += table_section("`afold`: o_proj / down_proj A-folded (W_a = [W; A of every slot], the next norm adds "
                               "the delta); LoRA µs per step over the base, and step / base",
                               ["model", "decode bs", "base µs/step", "LoRA fused", "LoRA rowwise", "LoRA afold",
                                "LoRA afold_expand", "afold / best", "afold step / base", "best step / base"], afolds)
    if args.early_start:
        lines += table_section(f"`fused` with the early-start knobs (default: the norm kernel a PDL dependent up to "
                               f"{nsp.PDL_MAX_ROWS} rows, SiLU-and-mul releasing at its start; GPU µs per step, the "
                               "same graph of the four folded modules)",
                               ["model", "decode bs", "default", "norm kernel never PDL", "norm kernel always PDL",
                                "SiLU-and-mul without early release", "all off", "all off - default",
                                "outputs equal"], early)
    if args.early_loads:
        lines += table_section("Early loads: each variant with norm_shrink_pack.EARLY_LOADS and "
                               "rmsnorm.WEIGHT_FIRST (`fused` also with NORM_WEIGHT_EARLY; GPU µs per step, the same "
                               "graph of the four folded modules)",
                               ["model", "decode bs", "base", "base early", "fused", "fused early",
                                "fused early + norm weight", "rowwise", "rowwise early", "fused early saves µs/launch",
                                "outputs equal"], loads)
    emit_table(lines, args.out)


def early_loads_row(shape: str, step: "Step", dry: bool) -> str:
    """`base`, `fused` and `rowwise` with the early-load knobs off and on: GPU µs per step, and
    whether every output equals the knobs-off one bit for bit (the knobs move loads, never sums)."""
    from sglang.srt.layers.triton_ops import rmsnorm

    times, outs = [], {}
    for on in (False, True):
        with module_knobs([(nsp, "EARLY_LOADS", on), (rmsnorm, "WEIGHT_FIRST", on), (nsp, "NORM_WEIGHT_EARLY", False)]):
            for variant in (step.base, step.fused, step.rowwise):
                variant()
                outs[(variant.__name__, on)] = [o.clone() for o in step.outs]
                times.append(float("nan") if dry else graph_us(lambda _, v=variant: v()))
    # And the norm's weight with the row (74 registers, not 64).
    with module_knobs([(nsp, "EARLY_LOADS", True), (rmsnorm, "WEIGHT_FIRST", True), (nsp, "NORM_WEIGHT_EARLY", True)]):
        step.fused()
        outs[("fused", "weight")] = [o.clone() for o in step.outs]
        times.append(float("nan") if dry else graph_us(lambda _: step.fused()))
    equal = all(torch.equal(a, b) for name in ("base", "fused", "rowwise")
                for a, b in zip(outs[(name, False)], outs[(name, True)]))
    equal = equal and all(torch.equal(a, b) for a, b in zip(outs[("fused", False)], outs[("fused", "weight")]))
    # The norm-fed half of the step's modules runs norm_shrink_pack in `fused`.
    per_launch = 2 * (times[1] - times[4]) / len(step.mods)
    row = (f"| {shape} | {step.bs} | {times[0]:.0f} | {times[3]:.0f} | {times[1]:.0f} | {times[4]:.0f} | "
           f"{times[6]:.0f} | {times[2]:.0f} | {times[5]:.0f} | {per_launch:.2f} | {'yes' if equal else 'NO'} |")
    print(row, flush=True)
    return row


EARLY_KNOBS = ((nsp, "PDL_MAX_ROWS"), (common, "RELEASE_DEPENDENTS"))
ALWAYS = 1 << 30


def early_start_rows(shape: str, step: "Step", dry: bool) -> list[str]:
    """`fused` with the early-start knobs as they are (the default), the norm kernel never and
    always a PDL dependent, SiLU-and-mul without its early release, all off: GPU µs per step, and
    whether every output equals the default's bit for bit (the knobs move loads, never sums)."""
    defaults = [getattr(mod, name) for mod, name in EARLY_KNOBS]
    settings = [tuple(defaults), (0, defaults[1]), (ALWAYS, defaults[1]), (defaults[0], False), (0, False)]
    times, equal, ref = [], True, None
    for setting in settings:
        with module_knobs([(mod, name, value) for (mod, name), value in zip(EARLY_KNOBS, setting)]):
            step.fused()
            outs = [o.clone() for o in step.outs]
            if ref is None:
                ref = outs
            equal = equal and all(torch.equal(o, r) for o, r in zip(outs, ref))
            times.append(float("nan") if dry else graph_us(lambda _: step.fused()))
    row = f"| {shape} | {step.bs} | " + " | ".join(f"{t:.0f}" for t in times)
    row += f" | {times[-1] - times[0]:.0f} | {'yes' if equal else 'NO'} |"
    print(row, flush=True)
    return [row]


def fused_with_tile(step: "Step", tile: int, ref: list[torch.Tensor], dry: bool) -> tuple[float, float]:
    """`fused` (GPU µs per step) with norm_shrink_pack's column tile from `tile` elements, and its
    max relative difference from `unfused`'s outputs."""
    with module_knobs([(nsp, "TILE_ELEMENTS", tile)]):
        step.fused()
        diff = max(float((o.float() - r).abs().max() / r.abs().max().clamp_min(1e-6)) for o, r in zip(step.outs, ref))
        return (float("nan") if dry else graph_us(lambda _: step.fused())), diff


def table_section(title: str, header: list[str], rows: list[str]) -> list[str]:
    """A titled markdown table: the first column left-aligned (a name), the others right-aligned,
    except a last column of yes / no."""
    last = "---" if header[-1].startswith("outputs equal") else "---:"
    aligns = ["---"] + ["---:"] * (len(header) - 2) + [last]
    return [title, "", "| " + " | ".join(header) + " |", "|" + "|".join(aligns) + "|", *rows, ""]


if __name__ == "__main__":
    main()
