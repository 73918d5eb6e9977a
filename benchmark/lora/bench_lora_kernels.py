"""LoRA module designs side by side: GPU µs per decoder layer under CUDA-graph replay, host µs per call.

    PYTHONPATH=$PWD/python python benchmark/lora/bench_lora_kernels.py [--models llama-3.1-8b qwen3-4b]
        [--tokens 1 128 2048] [--adapters 1 4] [--rank 16] [--high-rank 64] [--out results.md]
    PYTHONPATH=$PWD/python python benchmark/lora/bench_lora_kernels.py --cpu-dry-run   # tiny, interpreter

Variants (lora_kernel_variants.py), all through `backend.run_module` as the LoRA layers call it:
`csgmv/unfold` and `tok+pdl` add LoRA after the base GEMM (csgmv's and triton's kernels for modules
that are not folded); `fold` / `fold+pdl` fold every module into its base GEMM (shrink_pack + one
GEMM over W_aug); `auto` (high-rank table) folds what lora/fold.py's rule folds. 8 pool slots,
slot 0 the base model; 1 and 16 tokens are decode batches (one token per request), 128 and 2048 are
4 prefill requests; n adapters occupy slots 1..n, requests round-robin. Each variant's LoRA deltas
(output - base GEMM) are first checked against an fp32 reference (`check`: worst relative
Frobenius error; bf16 rounding gives ~3e-3).

Tables:
  1. per model: `base` = the four base GEMMs (µs per layer, graph replay); `base/W_aug` = the same
     GEMMs reading the strided view W_aug[:, :K] (an all-base batch on a LoRA server); then each
     variant's LoRA µs per layer = (its four modules) - base; `×L ms` scales the best variant to the
     model's layers. The issue's targets (8B, rank 16, 7 modules): 128-token prefill <= 0.6 ms
     (18.7 µs per layer), decode at batch 1 <= 0.4 ms (12.5 µs per layer).
  2. rank R_high (default 64), 8B: `fold` (everything folded), `auto` (the rule), `tok+pdl`
     (nothing folded): where folding stops paying (extra E*N weight bytes every forward).
  3. host µs per module call, eager, 128-token prefill (base GEMM included; `base` alone for scale).

Arithmetic (8B, rank 16, 8 slots, bf16; E = 8*c*16 columns: qkv 384, o 128, gate_up 256, down 128):
  - The folded GEMMs read E*N extra weight elements per layer: 6144*384 + 4096*128 + 28672*256 +
    4096*128 = 10.7 M -> 21 MB, ~5 µs at 4.3 TB/s, whatever the adapters of the batch. The
    shrink_pack kernels are four small latency-bound kernels (~2-4 µs each at decode).
  - At 2048 tokens the extra FLOPs are 2*T*N*E = 44 GFLOP per layer (~60 µs), plus the copies of x
    into x_aug (4*T*K bytes: ~50 µs for the four modules), against ~220 µs for today's unfused
    kernels.
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
from sglang.srt.lora.backend.triton_backend import TritonLoRABackend  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

MODELS = {"llama-3.1-8b": (Shapes(4096, 4096, 1024, 14336), 32), "qwen3-4b": (Shapes(2560, 4096, 1024, 9728), 36)}
TINY = Shapes(64, 64, 32, 96)
NUM_SLOTS = 8
REPS = 10  # layers per captured graph


def make_io(shapes: Shapes, rows: int, dtype, device, gen) -> dict[str, torch.Tensor]:
    return {k: torch.randn(rows, d, generator=gen, device=device).to(dtype)
            for k, d in (("x", shapes.hidden), ("attn", shapes.q), ("act", shapes.inter))}


def make_case(tokens: int, adapters: int, R: int, device: str) -> Case:
    if tokens <= 16:
        lens, mode = [1] * tokens, ForwardMode.DECODE
    else:
        lens, mode = [tokens // 4] * 3 + [tokens - 3 * (tokens // 4)], ForwardMode.EXTEND
    slots = [1 + i % adapters for i in range(len(lens))]
    ranks = [0] + [R] * adapters + [0] * (NUM_SLOTS - 1 - adapters)
    scalings = [0.0] + [0.5 + i for i in range(adapters)] + [0.0] * (NUM_SLOTS - 1 - adapters)
    return Case(lens, slots, mode, ranks, scalings, device)


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
    return triton.testing.do_bench(graph.replay, warmup=10, rep=40) * 1e3 / REPS


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

    def emit(self, line: str = "") -> None:
        self.lines.append(line)
        print(line, flush=True)
        if self.args.out:
            Path(self.args.out).write_text("\n".join(self.lines) + "\n")

    def time(self, fn) -> float:
        return float("nan") if self.dry else gpu_time_us(fn)

    def check(self, variant: BackendVariant, case: Case, weights: LayerWeights, io: dict) -> float:
        variant.prepare(case, graph=True)
        return relative_error(variant.layer(io), base_gemms(weights, io), reference_deltas(case, weights, io))

    def rows_for(self, variants, weights, tokens_list, adapters_list, layers, with_view: bool) -> dict:
        """One table: a row per (tokens, adapters). Returns {(tokens, variant): LoRA µs} (1 adapter)."""
        head = ["tokens", "adapters", "base"] + (["base/W_aug"] if with_view else []) + [v.name for v in variants]
        head += [f"best ×{layers} ms", "check"]
        self.emit("| " + " | ".join(head) + " |")
        self.emit("|" + "---:|" * len(head))
        lora_us = {}
        for tokens in tokens_list:
            for adapters in adapters_list:
                case = make_case(tokens, adapters, weights.max_rank, self.device)
                io = make_io(weights.shapes, case.rows, self.dtype, self.device, self.gen)
                print(f"== {tokens} tokens, {adapters} adapter(s)", file=sys.stderr)
                base = cell(lambda: self.time(lambda: base_gemms(weights, io)))
                row = [str(tokens), str(adapters), fmt(base)]
                if with_view:
                    row.append(fmt(cell(lambda: self.time(lambda: base_gemms(weights, io, strided=True)))))
                errs, best = [], None
                for v in variants:
                    err = cell(lambda: self.check(v, case, weights, io))
                    total = cell(lambda: self.time(lambda: v.layer(io))) if err is not None else None
                    lora = None if (total is None or base is None) else total - base
                    errs.append(f"{v.name} {'err' if err is None else f'{err:.0e}'}")
                    row.append(fmt(lora))
                    if lora is not None and lora == lora:
                        best = lora if best is None else min(best, lora)
                        lora_us[(tokens, adapters, v.name)] = lora
                row.append(fmt(best * layers / 1e3, 2) if best is not None else "-")
                bad = [e for e in errs if e.endswith("err") or float(e.split()[-1]) > self.tol]
                row.append("ok" if not bad else "FAIL: " + ", ".join(bad))
                print("    " + "; ".join(errs), file=sys.stderr)
                self.emit("| " + " | ".join(row) + " |")
        return lora_us

    def host_table(self, variants, weights) -> None:
        tokens = 40 if self.dry else 128
        case = make_case(tokens, 1, weights.max_rank, self.device)
        io = make_io(weights.shapes, case.rows, self.dtype, self.device, self.gen)
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
                  "metadata copy and, on the first batch of a row count, the launch plans)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--high-rank", type=int, default=64, help="rank of table 2 (0: skip it)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 128, 2048])
    p.add_argument("--adapters", type=int, nargs="+", default=[1, 4])
    p.add_argument("--out", help="also write the tables to this markdown file")
    p.add_argument("--no-pdl", action="store_true", help="leave out the PDL variants")
    p.add_argument("--cpu-dry-run", action="store_true", help="tiny shapes, fp32, CPU interpreter, no timing")
    args = p.parse_args()
    dry = args.cpu_dry_run
    if not dry and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (or --cpu-dry-run)")
    bench = Bench(args, dry)
    if dry:
        models = {"TINY (dry run)": (TINY, 2)}
        args.tokens, args.adapters = [1, 16, 40], [1, 3]
    else:
        models = {m: MODELS[m] for m in args.models}
    pdl = not dry and not args.no_pdl
    bench.emit(f"# LoRA module designs, rank {args.rank}, {NUM_SLOTS} slots, {bench.dtype}, torch {torch.__version__}"
               + ("" if dry else f", {torch.cuda.get_device_name()}"))
    first = None
    for name, (shapes, layers) in models.items():
        weights = LayerWeights(shapes, NUM_SLOTS, args.rank, bench.dtype, bench.device, bench.gen)
        variants = make_variants(weights, bench.device, pdl)
        bench.emit()
        bench.emit(f"## {name}: LoRA µs per layer = (four modules) - (four base GEMMs), graph replay")
        bench.emit()
        bench.rows_for(variants, weights, args.tokens, args.adapters, layers, with_view=True)
        first = first or (shapes, layers, weights, variants)

    if args.high_rank:
        shapes, layers, _, _ = first
        weights = LayerWeights(shapes, NUM_SLOTS, args.high_rank, bench.dtype, bench.device, bench.gen)
        unfolded = "tok+pdl" if pdl else "tok"
        variants = [
            BackendVariant("fold", TritonLoRABackend, "on", pdl, weights),
            BackendVariant("auto", TritonLoRABackend, "auto", pdl, weights),
            BackendVariant(unfolded, TritonLoRABackend, "off", pdl, weights),
        ]
        folded = [m for m in MODULES if weights.auto_folds(m)]
        bench.emit()
        bench.emit(f"## rank {args.high_rank}, {NUM_SLOTS} slots: where folding stops paying (auto folds {folded})")
        bench.emit()
        bench.rows_for(variants, weights, args.tokens, [1], layers, with_view=False)

    _, _, weights, variants = first
    bench.host_table(variants, weights)


if __name__ == "__main__":
    main()
