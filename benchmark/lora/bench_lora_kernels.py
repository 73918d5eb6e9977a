"""LoRA kernel designs side by side: GPU µs per decoder layer under CUDA-graph replay, host µs per launch.

    PYTHONPATH=$PWD/python python benchmark/lora/bench_lora_kernels.py [--model llama-3.1-8b|qwen3-4b]
        [--tokens 1 16 128 2048] [--adapters 1 4] [--rank 16] [--out results.md]
    PYTHONPATH=$PWD/python python benchmark/lora/bench_lora_kernels.py --cpu-dry-run   # tiny, interpreter

Variants (lora_kernel_variants.py): today's `triton` and `csgmv` backends with their graph-static
metadata, the token-major kernels `tok` (and `tok+pdl`), and a torch/cuBLAS-only `dense` design.
Batches: 1 and 16 tokens are decode batches (one token per request); 128 and 2048 tokens are 4
prefill requests. Slot 0 is the base model; n adapters occupy slots 1..n, requests round-robin.
Every variant's LoRA deltas are first checked against an fp32 reference (column `check`: the
worst relative Frobenius error over modules; bf16 rounding gives ~3e-3).

Tables:
  1. per-layer GPU µs (qkv + o + gate_up + down), a CUDA graph of REPS layers replayed; the
     "×L" columns scale to the model's layers, the issue's targets (8B, rank 16): 128-token
     prefill <= 0.6 ms, decode at batch 1 <= 0.4 ms. `base` = the four base GEMMs; `base+tok` =
     base GEMMs and tok LoRA; `base+tok∥` = the same with each shrink on a side stream beside
     its base GEMM (the shrink only needs the GEMM's input).
  2. per-module GPU µs (1 adapter).
  4. tok's shrink by K split (1 and 128 tokens, qkv and down): tunes plan_shrink's target.
  3. host µs, eager, 128-token prefill: `prepare` = metadata + launch plans for one batch;
     `per launch` = one layer's LoRA calls / launches per layer (target <= 30).

Arithmetic that bounds the answer (8B: h 4096, q 4096, kv 1024, I 14336, rank 16, bf16):
  - Bytes per layer at 128 tokens: shrink inputs x 1 MB (twice), attn 1 MB, act 3.7 MB; expand
    read-modify-writes of qkv 3.1 MB, o 2 MB, gate_up 14.7 MB, down 2 MB; adapter A+B 2.8 MB per
    adapter. ~31 MB -> 7 µs at 4.3 TB/s, 0.23 ms per forward. FLOPs are negligible (14 µs total).
  - So the budget (0.6 ms / 32 layers = 18.7 µs per layer for 8 kernels) is mostly latency: a
    dependent kernel costs ~2 µs even when tiny, and today's triton graph grid launches 32 segment
    slots x lanes x column tiles (14,336 programs for gate_up's expand, 448 with work), plus a
    memset per split-K shrink (12 kernels per layer).
  - Decode bs 1: bytes are the adapter's 2.8 MB per layer (0.65 µs): pure latency, 0.4 ms / 32 =
    12.5 µs per layer for 8 launches -> shrink and expand must each be ~1.5 µs, or overlap (PDL,
    or the shrink beside the base GEMM on a side stream).
  - dense reads every slot's B: S x 1.38 MB per layer (S = 8 slots: 11 MB, 2.6 µs) and launches
    14 kernels per layer; it wins only if cuBLAS's efficiency at 2048 tokens outweighs that.
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
    DenseVariant,
    Shapes,
    TokenVariant,
    reference_deltas,
)
from sglang.srt.lora.backend.chunked_backend import ChunkedSgmvLoRABackend  # noqa: E402
from sglang.srt.lora.backend.triton_backend import TritonLoRABackend  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

MODELS = {"llama-3.1-8b": (Shapes(4096, 4096, 1024, 14336), 32), "qwen3-4b": (Shapes(2560, 4096, 1024, 9728), 36)}
TINY = Shapes(64, 64, 32, 96)
NUM_SLOTS = 8
REPS = 10  # layers per captured graph
SWEEP_SPLITS = (1, 4, 8, 16, 32)


def make_weights(shapes: Shapes, R: int, dtype, device, gen) -> dict[str, torch.Tensor]:
    """Pool-shaped A [S, c*R, in] and B [S, out, R] (every adapter at rank R: zero padding unused)."""
    w = {}
    for m in MODULES:
        _, in_dim, c, slices = shapes.module(m)
        out_dim = slices[-1][1]
        w[f"{m}_a"] = (torch.randn(NUM_SLOTS, c * R, in_dim, generator=gen, device=device) / in_dim**0.5).to(dtype)
        w[f"{m}_b"] = (torch.randn(NUM_SLOTS, out_dim, R, generator=gen, device=device) / R**0.5).to(dtype)
    return w


def make_io(shapes: Shapes, rows: int, dtype, device, gen) -> dict[str, torch.Tensor]:
    def rnd(width):
        return torch.randn(rows, width, generator=gen, device=device).to(dtype)

    s = shapes
    return {"x": rnd(s.hidden), "attn": rnd(s.q), "act": rnd(s.inter),
            "qkv": rnd(s.q + 2 * s.kv), "o": rnd(s.hidden), "gate_up": rnd(2 * s.inter), "down": rnd(s.hidden)}


def make_case(tokens: int, adapters: int, R: int, device: str) -> Case:
    if tokens <= 16:
        lens, mode = [1] * tokens, ForwardMode.DECODE
    else:
        lens, mode = [tokens // 4] * 3 + [tokens - 3 * (tokens // 4)], ForwardMode.EXTEND
    slots = [1 + i % adapters for i in range(len(lens))]
    ranks = [0] + [R] * adapters + [0] * (NUM_SLOTS - 1 - adapters)
    scalings = [0.0] + [0.5 + i for i in range(adapters)] + [0.0] * (NUM_SLOTS - 1 - adapters)
    return Case(lens, slots, mode, ranks, scalings, device)


def check(variant, io, bases, w, ref) -> float:
    """Worst relative error of the variant's deltas against the fp32 reference. `bases` are the
    pristine base outputs (timing runs keep adding into io's, which would swamp bf16 deltas)."""
    outs = {m: bases[m].clone() for m in MODULES}
    variant.layer({**io, **outs}, w)
    worst = 0.0
    for m in MODULES:
        delta = outs[m].float() - bases[m].float()
        err = (delta - ref[m]).norm().item() / max(ref[m].norm().item(), 1e-30)
        worst = max(worst, err if torch.isfinite(delta).all() else float("inf"))
    return worst


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


def cell(fn) -> str:
    try:
        return f"{fn():.1f}"
    except Exception as e:  # one failing design must not sink the run
        print(f"    ! {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
        return "err"


def sweep_splits(emit, time_it, shapes, R, dtype, device, gen, w, dry) -> None:
    """Table 4: one module (shrink + expand) of tok by forced K split."""
    sweep = TokenVariant(shapes, NUM_SLOTS, R, device, dtype, use_pdl=False)
    for tokens in (1, 40 if dry else 128):
        case = make_case(tokens, 1, R, device)
        io = make_io(shapes, case.rows, dtype, device, gen)
        for m in ("qkv", "down"):
            sweep.split = None
            sweep.prepare(case, graph=True)
            default = sweep.shrink[m].bound.constexprs["SPLIT"]
            cells = []
            for split in SWEEP_SPLITS:
                sweep.split = split
                sweep.prepare(case, graph=True)
                cells.append(time_it(lambda: sweep.module(m, io, w)))
            emit(f"| {tokens} | {m} | {default} | " + " | ".join(cells) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=list(MODELS), default="llama-3.1-8b")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 2048])
    p.add_argument("--adapters", type=int, nargs="+", default=[1, 4])
    p.add_argument("--out", help="also write the tables to this markdown file")
    p.add_argument("--no-sweep", action="store_true", help="skip table 4 (shrink K-split sweep)")
    p.add_argument("--no-pdl", action="store_true", help="leave out tok+pdl (programmatic dependent launch)")
    p.add_argument("--cpu-dry-run", action="store_true", help="tiny shapes, fp32, CPU interpreter, no timing")
    args = p.parse_args()

    dry = args.cpu_dry_run
    if dry:
        shapes, layers, device, dtype = TINY, 2, "cpu", torch.float32
        args.tokens, args.adapters, tol = [1, 16, 40], [1, 3], 1e-4
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA device (or --cpu-dry-run)")
        (shapes, layers), device, dtype, tol = MODELS[args.model], "cuda", torch.bfloat16, 3e-2
    R = args.rank
    gen = torch.Generator(device=device).manual_seed(0)
    w = make_weights(shapes, R, dtype, device, gen)
    base_w = {m: (torch.randn(shapes.module(m)[3][-1][1], shapes.module(m)[1], generator=gen, device=device)
                  / shapes.module(m)[1] ** 0.5).to(dtype) for m in MODULES}
    dense = DenseVariant(shapes, NUM_SLOTS, R, device, dtype)
    dense.relayout(w)
    variants = [
        BackendVariant("triton", lambda: TritonLoRABackend(NUM_SLOTS, device), shapes, NUM_SLOTS, device),
        BackendVariant("csgmv", lambda: ChunkedSgmvLoRABackend(NUM_SLOTS, device), shapes, NUM_SLOTS, device),
        TokenVariant(shapes, NUM_SLOTS, R, device, dtype, use_pdl=False),
        dense,
    ]
    if not dry and not args.no_pdl:  # last: a failed PDL capture should spoil nothing before it
        variants.append(TokenVariant(shapes, NUM_SLOTS, R, device, dtype, use_pdl=True))
    tok = variants[2]
    names = [v.name for v in variants]
    time_it = (lambda fn: "-") if dry else (lambda fn: cell(lambda: gpu_time_us(fn)))
    def emit(line: str) -> None:
        lines.append(line)
        print(line, flush=True)
        if args.out:
            Path(args.out).write_text("\n".join(lines) + "\n")

    lines: list[str] = []
    header = [f"# LoRA kernels, {'TINY (dry run)' if dry else args.model} shapes, rank {R}, {NUM_SLOTS} slots, "
             f"{dtype}, torch {torch.__version__}"
             + (f", {torch.cuda.get_device_name()}" if not dry else ""), ""]
    for line in header:
        emit(line)

    # ---- 1. per layer -------------------------------------------------------------------------
    head = ["tokens", "adapters", "base"] + names + ["base+tok", "base+tok∥", f"{tok.name} ×{layers} ms", "check"]
    emit("| " + " | ".join(head) + " |")
    emit("|" + "---:|" * len(head))
    per_module: list[str] = []
    for tokens in args.tokens:
        for adapters in args.adapters:
            case = make_case(tokens, adapters, R, device)
            io = make_io(shapes, case.rows, dtype, device, gen)
            ref = reference_deltas(case, shapes, io, w)
            bases = {m: io[m].clone() for m in MODULES}
            print(f"== {tokens} tokens, {adapters} adapter(s)", file=sys.stderr)
            row = [str(tokens), str(adapters),
                   time_it(lambda: [torch.matmul(io[shapes.module(m)[0]], base_w[m].T, out=io[m]) for m in MODULES])]
            errs, per_layer = [], {}
            for v in variants:
                try:
                    v.prepare(case, graph=True)
                    errs.append(f"{v.name} {check(v, io, bases, w, ref):.0e}")
                    per_layer[v.name] = time_it(lambda: v.layer(io, w))
                except Exception as e:
                    print(f"    ! {v.name}: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
                    errs.append(f"{v.name} err")
                    per_layer[v.name] = "err"
                row.append(per_layer[v.name])
                if adapters == 1 and not dry and per_layer[v.name] != "err":
                    mods = [time_it(lambda m=m: v.module(m, io, w)) for m in MODULES]
                    per_module.append(f"| {tokens} | {v.name} | " + " | ".join(mods) + " |")
            if "err" in per_layer.get(tok.name, "err"):
                row += ["err", "err"]
            elif dry:  # the code path only: plain torch matmul + LoRA on the CPU
                tok.prepare(case, graph=True)
                for m in MODULES:
                    tok.module_with_base(m, io, w, base_w, None)
                row += ["-", "-"]
            else:
                tok.prepare(case, graph=True)
                side = torch.cuda.Stream()
                row.append(time_it(lambda: [tok.module_with_base(m, io, w, base_w, None) for m in MODULES]))
                row.append(time_it(lambda: [tok.module_with_base(m, io, w, base_w, side) for m in MODULES]))
            t = per_layer.get(tok.name, "err")
            row.append(f"{float(t) * layers / 1e3:.2f}" if t not in ("err", "-") else t)
            bad = [e for e in errs if e.endswith("err") or float(e.split()[-1]) > tol]
            row.append("ok" if not bad else "FAIL: " + ", ".join(bad))
            print("    " + "; ".join(errs), file=sys.stderr)
            emit("| " + " | ".join(row) + " |")

    # ---- 2. per module ------------------------------------------------------------------------
    if per_module:
        for line in ["", "GPU µs per module (1 adapter), graph replay", "",
                     "| tokens | variant | " + " | ".join(MODULES) + " |", "|---:|---|" + "---:|" * len(MODULES)]:
            emit(line)
        for line in per_module:
            emit(line)

    # ---- 4 (printed before 3). tok's K split for the latency-bound shrinks ---------------------
    if not args.no_sweep:
        for line in ["", "tok: GPU µs of one module (shrink + expand) by the shrink's K split (1 adapter)", "",
                     "| tokens | module | default split | " + " | ".join(f"split {s}" for s in SWEEP_SPLITS) + " |",
                     "|---:|---|---:|" + "---:|" * len(SWEEP_SPLITS)]:
            emit(line)
        try:
            sweep_splits(emit, time_it, shapes, R, dtype, device, gen, w, dry)
        except Exception as e:  # a tuning table must not cost the host-time table
            print(f"    ! sweep: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)

    # ---- 3. host time, eager ------------------------------------------------------------------
    tokens = 128 if not dry else 40
    case = make_case(tokens, 1, R, device)
    io = make_io(shapes, case.rows, dtype, device, gen)
    for line in ["", f"Host µs, eager, {tokens}-token prefill, 1 adapter", "",
                 "| variant | prepare | layer | launches | per launch |", "|---|---:|---:|---:|---:|"]:
        emit(line)
    n = 3 if dry else 50
    unbound = TokenVariant(shapes, NUM_SLOTS, R, device, dtype, use_pdl=False, bound=False)
    for v in variants + [unbound]:
        prep = cell(lambda: host_us(lambda: v.prepare(case, graph=False), n))
        layer = cell(lambda: host_us(lambda: v.layer(io, w), n))
        per = f"{float(layer) / v.launches_per_layer:.1f}" if layer != "err" else "err"
        emit(f"| {v.name} | {prep} | {layer} | {v.launches_per_layer} | {per} |")
    fast = sum(launch.bound.fast_launches for launch in list(tok.shrink.values()) + list(tok.expand.values()))
    emit(f"\n(tok: {fast} launches took the bound fast path; 'prepare' includes allocating its buffers)")


if __name__ == "__main__":
    main()
