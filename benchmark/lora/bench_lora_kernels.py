"""LoRA module designs at serving shapes: GPU µs per decoder layer under CUDA-graph replay, against the base GEMMs.

    PYTHONPATH=$PWD/python python benchmark/lora/bench_lora_kernels.py [--models qwen3-4b llama-3.1-8b]
        [--ranks 16 64] [--decode-bs 1 8 32 64 128] [--adapters 1 4 8 16] [--prefill 4x512 8x256] [--out f.md]
    PYTHONPATH=$PWD/python python benchmark/lora/bench_lora_kernels.py --cpu-dry-run   # tiny, interpreter

Variants (lora_kernel_variants.py), all through `backend.run_module` as the LoRA layers call it,
every launch over the batch's adapter segments (lora/segments.py):
  csgmv/unfold  `csgmv` with no module folded: base GEMM, then the chunked SGMV shrink and expand
  tok           `triton` with no module folded: base GEMM, token-major shrink (split-K) and expand
  fold          `triton`, every module folded: shrink_pack writes [x | packed shrink], then ONE
                cuBLAS GEMM over W_aug = [W | block-diagonal B of every slot]
  auto          what `--lora-fold auto` picks per module (lora/fold.py's rule)
  fold/k256w8   `fold` with token_lora's knobs changed (--tunings: K per split, warps, K tile)
PDL is on where the GPU has it. Cases: decode batches (one token per request) of `--decode-bs` on
`--adapters` distinct adapters (requests take them in turn), and prefill batches (`--prefill`,
requests x tokens) on 8 adapters. Pool slots: 9 (8 adapters + the base model, the serving
default) up to 8 adapters, else adapters + 1. A last table per model holds the batch's adapters at
8 and grows the pool (`--slots`), at decode (`--slot-sweep-bs`) and at a long prefill
(`--slot-sweep-prefill`, where W_aug's extra columns cost FLOPs): where folding stops paying
(lora/fold.py's rule should fall there). Every variant's LoRA deltas (output - base GEMM) are
first checked against an fp32 reference (`check`: worst relative Frobenius error; bf16 gives ~3e-3).

Columns: `base` = the four base GEMMs (µs per layer, graph replay); each variant's LoRA µs per layer
= (its four modules) - base; `LoRA ms/step` = the best variant x layers; `(base+LoRA)/base` of the
GEMMs; then the best variant's LoRA µs per module (module - its base GEMM). The whole decode step
(attention, norms, the eager tail) is measured by benchmark/profile_forward.py.

Floor (Qwen3-4B, rank 16, all modules, bf16): an adapter's A and B hold r * [(h+q) + 2(h+kv) + (q+h)
+ 2(h+I) + (I+h)] = 16 * 57,344 elements per layer, 1.8 MB, so a batch on n adapters reads n * 1.8
MB per layer: 8 adapters 14.7 MB, ~3.4 µs per layer at 4.3 TB/s (0.12 ms per 36-layer step). The
folded GEMMs also read W_aug's extra columns (every slot's B), whatever the batch uses.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "python"))
sys.path.insert(0, str(HERE))
if "--cpu-dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402

from lora_kernel_variants import (  # noqa: E402
    MODULES,
    BackendVariant,
    Case,
    LayerWeights,
    Shapes,
    base_gemms,
    make_variants,
    reference_deltas,
    relative_error,
)
from sglang.srt.configs.forward_batch_info import ForwardMode  # noqa: E402

MODELS = {"llama-3.1-8b": (Shapes(4096, 4096, 1024, 14336), 32), "qwen3-4b": (Shapes(2560, 4096, 1024, 9728), 36)}
TINY = Shapes(64, 64, 32, 96)
SERVING_SLOTS = 9  # --max-loras-per-batch 8 plus the base model's slot
PREFILL_ADAPTERS = 8
REPS = 10  # layers per captured graph


def make_io(shapes: Shapes, rows: int, dtype, device, gen) -> dict[str, torch.Tensor]:
    return {k: torch.randn(rows, d, generator=gen, device=device).to(dtype)
            for k, d in (("x", shapes.hidden), ("attn", shapes.q), ("act", shapes.inter))}


def make_case(lens: list[int], mode: ForwardMode, adapters: int, num_slots: int, R: int, device: str) -> Case:
    """Requests take adapters 1..n in turn (slot 0: the base model, rank 0); other slots are empty."""
    slots = [1 + i % adapters for i in range(len(lens))]
    ranks = [0] + [R] * adapters + [0] * (num_slots - 1 - adapters)
    scalings = [0.0] + [0.5 + 0.1 * i for i in range(adapters)] + [0.0] * (num_slots - 1 - adapters)
    return Case(lens, slots, mode, ranks, scalings, device)


def slot_cases(args) -> list[tuple[str, list[int], ForwardMode, int, int]]:
    """The fold crossover: decode of `--slot-sweep-bs` requests, and the `--slot-sweep-prefill`
    batch, on 8 adapters (fewer if the pool is smaller) with the pool's slot count growing (W_aug
    widens with every slot). At prefill the extra columns cost FLOPs (2*T*N*E), not only bytes:
    `auto` against `tok` is what folding o_proj / down_proj costs there once qkv / gate_up are
    unfolded."""
    bs = args.slot_sweep_bs
    cases = []
    for slots in args.slots:
        cases.append((f"decode {bs}", [1] * bs, ForwardMode.DECODE, min(8, slots - 1), slots))
        if args.slot_sweep_prefill:
            n, t = (int(v) for v in args.slot_sweep_prefill.split("x"))
            cases.append((f"prefill {n}x{t}", [t] * n, ForwardMode.EXTEND, min(8, slots - 1), slots))
    return cases


def serving_cases(args) -> list[tuple[str, list[int], ForwardMode, int]]:
    """(label, request lengths, mode, adapters) of the table's rows."""
    cases = []
    for bs in args.decode_bs:
        for n in args.adapters:
            if n <= bs:
                cases.append((f"decode {bs}", [1] * bs, ForwardMode.DECODE, n))
    for item in args.prefill:
        reqs, tokens = (int(v) for v in item.lower().split("x"))
        cases.append((f"prefill {reqs}x{tokens}", [tokens] * reqs, ForwardMode.EXTEND, min(PREFILL_ADAPTERS, reqs)))
    return cases


def gpu_time_us(fn) -> float:
    """GPU µs of one `fn`: a graph of REPS calls, replayed (no Python launch cost)."""
    import triton

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile / warm up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPS):
            fn()
    return triton.testing.do_bench(graph.replay, warmup=5, rep=25) * 1e3 / REPS


def host_us(fn, n: int) -> float:
    fn()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    sync()
    return (t1 - t0) * 1e6 / n


def cell(fn):
    try:
        return fn()
    except Exception as e:  # one failing design must not sink the run
        print(f"    ! {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
        return None


def fmt(v, digits: int = 1) -> str:
    return "err" if v is None else ("-" if v != v else f"{v:.{digits}f}")  # NaN: not timed (dry run)


class Bench:
    def __init__(self, args, dry: bool) -> None:
        self.args, self.dry, self.lines = args, dry, []
        self.device = "cpu" if dry else "cuda"
        self.dtype = torch.float32 if dry else torch.bfloat16
        self.tol = 1e-4 if dry else 3e-2
        self.gen = torch.Generator(device=self.device).manual_seed(0)
        self._weights: dict[tuple, LayerWeights] = {}
        self.last_variants: list[BackendVariant] = []

    def emit(self, line: str = "") -> None:
        self.lines.append(line)
        print(line, flush=True)
        if self.args.out:
            Path(self.args.out).write_text("\n".join(self.lines) + "\n")

    def time(self, fn) -> float:
        return float("nan") if self.dry else gpu_time_us(fn)

    def weights(self, shapes: Shapes, num_slots: int, rank: int) -> LayerWeights:
        key = (shapes, num_slots, rank)
        if key not in self._weights:
            self._weights.clear()  # one model, slot count and rank at a time
            if not self.dry:
                torch.cuda.empty_cache()
            self._weights[key] = LayerWeights(shapes, num_slots, rank, self.dtype, self.device, self.gen)
        return self._weights[key]

    def check(self, variant: BackendVariant, case: Case, weights: LayerWeights, io: dict) -> float:
        variant.prepare(case, graph=True)
        return relative_error(variant.layer(io), base_gemms(weights, io), reference_deltas(case, weights, io))

    def table(self, shapes: Shapes, layers: int, rank: int, cases, per_module: bool) -> None:
        head = ["case", "adapters", "slots", "base"] + [v for v in self.variant_names()]
        head += [f"LoRA ms/step (×{layers})", "(base+LoRA)/base"]
        head += [f"{m} µs" for m in MODULES] if per_module else []
        head += ["check"]
        self.emit("| " + " | ".join(head) + " |")
        self.emit("|---|" + "---:|" * (len(head) - 2) + "---|")
        for label, lens, mode, adapters, *slots in cases:
            num_slots = slots[0] if slots else max(SERVING_SLOTS, adapters + 1)
            weights = self.weights(shapes, num_slots, rank)
            case = make_case(lens, mode, adapters, num_slots, rank, self.device)
            io = make_io(shapes, case.rows, self.dtype, self.device, self.gen)
            print(f"== {label}, {adapters} adapter(s), rank {rank}", file=sys.stderr, flush=True)
            base = cell(lambda: self.time(lambda: base_gemms(weights, io)))
            row = [label, str(adapters), str(num_slots), fmt(base)]
            errs, best, best_v = [], None, None
            variants = make_variants(weights, self.device, not self.dry, self.args.tunings)
            self.last_variants = variants
            for v in variants:
                err = cell(lambda: self.check(v, case, weights, io))
                total = cell(lambda: self.time(lambda: v.layer(io))) if err is not None else None
                lora = None if (total is None or base is None) else total - base
                errs.append(f"{v.name} {'err' if err is None else f'{err:.0e}'}")
                row.append(fmt(lora))
                if lora is not None and lora == lora and (best is None or lora < best):
                    best, best_v = lora, v
            row.append(fmt(best * layers / 1e3, 3) if best is not None else "-")
            row.append(fmt((base + best) / base, 2) if best is not None and base else "-")
            if per_module:
                best_v = best_v or variants[-1]
                best_v.prepare(case, graph=True)
                for m in MODULES:
                    key = weights.shapes.module(m)[0]
                    module_base = cell(lambda: self.time(lambda: base_gemms(weights, io, only=m)))
                    module = cell(lambda: self.time(lambda: best_v.module(m, io)))
                    row.append(fmt(None if module is None or module_base is None else module - module_base))
            bad = [e for e in errs if e.endswith("err") or float(e.split()[-1]) > self.tol]
            row.append("ok" if not bad else "FAIL: " + ", ".join(bad))
            print("    " + "; ".join(errs), file=sys.stderr)
            self.emit("| " + " | ".join(row) + " |")

    def variant_names(self) -> list[str]:
        weights = LayerWeights(TINY, 2, 1, torch.float32, "cpu", torch.Generator().manual_seed(0))
        return [v.name for v in make_variants(weights, "cpu", not self.dry, self.args.tunings)]

    def host_table(self, shapes: Shapes) -> None:
        tokens = 40 if self.dry else 128
        weights = self.weights(shapes, SERVING_SLOTS, self.args.ranks[0])
        case = make_case([tokens // 4] * 4, ForwardMode.EXTEND, 1, SERVING_SLOTS, weights.max_rank, self.device)
        io = make_io(weights.shapes, case.rows, self.dtype, self.device, self.gen)
        variants = make_variants(weights, self.device, not self.dry, [])
        self.emit()
        self.emit(f"Host µs per module call, eager, {tokens}-token prefill, 1 adapter (base GEMM included)")
        self.emit()
        self.emit("| variant | prepare (per batch) | per module call | LoRA launches per layer |")
        self.emit("|---|---:|---:|---:|")
        n = 3 if self.dry else 50
        base = cell(lambda: host_us(lambda: base_gemms(weights, io), n))
        self.emit(f"| base GEMM only | - | {fmt(None if base is None else base / len(MODULES))} | 0 |")
        for v in variants:
            prep = cell(lambda: host_us(lambda: v.prepare(case, graph=False), n))
            layer = cell(lambda: host_us(lambda: v.layer(io), n))
            per = None if layer is None else layer / len(MODULES)
            self.emit(f"| {v.name} | {fmt(prep)} | {fmt(per)} | {v.lora_launches_per_layer} |")
        fast = sum(getattr(launch, "bound").fast_launches for v in variants if v.backend is not None
                   for ls in v.backend._launch_cache.values() for ml in ls.values()
                   for launch in (ml.pack, ml.shrink, ml.expand) if launch is not None)
        self.emit(f"\n(prepared launches that took the bound fast path: {fast}; 'prepare' includes the "
                  "segment build and its copy, and on the first batch of a shape the launch plans)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=["qwen3-4b", "llama-3.1-8b"])
    p.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    p.add_argument("--decode-bs", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    p.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--prefill", nargs="*", default=["4x512", "8x256"])
    p.add_argument("--tunings", nargs="*", default=[],
                   help="extra fold variants with token_lora's knobs, e.g. k256 k256w8 d128 (K per split, warps, K tile)")
    p.add_argument("--high-rank-decode-bs", type=int, nargs="*", default=[1, 64],
                   help="decode batches of the tables past the first rank (fewer rows)")
    p.add_argument("--slots", type=int, nargs="*", default=[9, 17, 33, 65],
                   help="pool slot counts of the fold-crossover table (slots include the base model's)")
    p.add_argument("--slot-sweep-bs", type=int, default=64, help="decode batch of the fold-crossover table")
    p.add_argument("--slot-sweep-prefill", default="4x2048",
                   help="prefill batch (requests x tokens) of the fold-crossover table ('' for none)")
    p.add_argument("--out", help="also write the tables to this markdown file")
    p.add_argument("--cpu-dry-run", action="store_true", help="tiny shapes, fp32, CPU interpreter, no timing")
    args = p.parse_args()
    dry = args.cpu_dry_run
    if not dry and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (or --cpu-dry-run)")
    bench = Bench(args, dry)
    if dry:
        models = {"TINY (dry run)": (TINY, 2)}
        args.decode_bs, args.adapters, args.prefill, args.ranks = [1, 16], [1, 3], ["2x20"], [16]
        args.slots, args.slot_sweep_bs, args.slot_sweep_prefill = [3, 5], 8, "2x20"
    else:
        models = {m: MODELS[m] for m in args.models}
    t0 = time.perf_counter()
    bench.emit(f"# LoRA modules at serving shapes, {bench.dtype}, torch {torch.__version__}"
               + ("" if dry else f", {torch.cuda.get_device_name()}") + f", {time.strftime('%Y-%m-%d')}")
    for name, (shapes, layers) in models.items():
        for i, rank in enumerate(args.ranks):
            sub = args if i == 0 else argparse.Namespace(**{**vars(args), "decode_bs": args.high_rank_decode_bs})
            bench.emit()
            bench.emit(f"## {name}, rank {rank}: LoRA µs per layer = (four modules) - (four base GEMMs), graph replay")
            bench.emit()
            bench.table(shapes, layers, rank, serving_cases(sub), per_module=i == 0)
        if args.slots:
            bench.emit()
            bench.emit(f"## {name}, rank {args.ranks[0]}: the fold crossover, more slots in the pool "
                       "(`auto` = what --lora-fold auto picks per module)")
            bench.emit()
            bench.table(shapes, layers, args.ranks[0], slot_cases(args), per_module=False)
    bench.host_table(next(iter(models.values()))[0])
    bench.emit(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
