"""Prefill and decode latency with and without LoRA, eager vs breakable vs full CUDA graphs.

One process, configurations side by side on the same dummy weights (GPU only):

    python benchmark/lora/bench_prefill_graph.py --out results.md [--models qwen3-4b,llama-3.1-8b,qwen2.5-0.5b]

For each model shape, three ModelRunners are built in turn (no LoRA; LoRA with the triton backend;
LoRA with csgmv). Each captures breakable prefill graphs and decode graphs for the measured sizes
(a LoRA runner captures both graph sets: with LoRA kernels, and without for all-base batches), and
full prefill graph runners are captured beside them on the same weights; the benchmark swaps the
runner's prefill path between eager, breakable and full and checks `used_cuda_graph` on every
measured forward against the runner's own decision, so a number is never silently an eager one.
LoRA cases use one rank-16 adapter on all seven modules (four distinct adapters for the
multi-request cases); `(all base)` cases send base requests to the LoRA runner (its graph set
without LoRA kernels), to compare with the runner without LoRA. The serving-size cases (N x 512
tokens, up to the 8192-token chunk; 9 x 512 replays padded to the 5120 bucket) show whether a
graph pays at that size. Times are medians of whole forwards (body + logits + sampling, i.e. what a
request's TTFT pays), with the device synchronised around each.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from runner_lib import (  # noqa: E402
    build_runner,
    decode_batch,
    prefill_batch,
    release,
    runner_takes_graph,
    time_forward,
    use_decode_graphs,
    use_prefill_graphs,
    write_assets,
)
from sglang.srt.configs.cuda_graph_config import Backend  # noqa: E402
from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import PrefillCudaGraphRunner  # noqa: E402

SHAPES = ("qwen3-4b", "llama-3.1-8b", "qwen2.5-0.5b")
PREFILL_TOKENS = [16, 128, 512, 2048, 4096]
NUM_ADAPTERS = 4
# Multi-request prefills with NUM_ADAPTERS distinct adapters: requests x tokens each. 4 x 32 and
# 4 x 512 hold the same token counts as the 128- and 2048-token single-adapter cases; 8, 9 and 16
# x 512 are serving-size batches (bench_serving's 512-token prompts), 9 x 512 padded to 5120.
MULTI_CASES = [(8, 128), (4, 32), (4, 512), (8, 512), (9, 512), (16, 512)]
PADDED_BUCKETS = [5120]
# Base requests on a LoRA server (the graph set without LoRA kernels) vs a server without LoRA.
ALL_BASE_PREFILL = [128]
ALL_BASE_DECODE_BS = [1]
DECODE_BS = [1, 8, 32]
LORA_MODES = ("none", "triton", "csgmv")

def runner_and_graphs(ckpt: str, lora_mode: str, adapters: dict[str, str]):
    """A runner with breakable prefill graphs at every measured size, and full prefill graph runners
    beside them. path -> (the set serving batches with LoRA work, the set for all-base batches of a
    LoRA runner)."""
    lora = lora_mode != "none"
    runner = build_runner(
        ckpt, lora_mode if lora else None, adapters,
        prefill_buckets=PREFILL_TOKENS + [n * t for n, t in MULTI_CASES] + PADDED_BUCKETS,
        decode_buckets=DECODE_BS,
    )
    graphs = {
        "eager": (None, None),
        "breakable": (runner.prefill_graph_runner, runner.base_prefill_graph_runner),
        "full": (PrefillCudaGraphRunner(runner, Backend.FULL, capture_lora=lora),
                 PrefillCudaGraphRunner(runner, Backend.FULL, capture_lora=False) if lora else None),
    }
    return runner, graphs


def bench_model(shape: str, root: str, warmup: int, repeats: int) -> list[dict]:
    ckpt, adapters = write_assets(root, shape, NUM_ADAPTERS)
    rows_out = []
    for mode in LORA_MODES:
        runner, graphs = runner_and_graphs(ckpt, mode, adapters)
        decode_graphs = (runner.decode_graph_runner, runner.base_decode_graph_runner)
        name = None if mode == "none" else "lora0"
        cases = [(f"prefill {n}", [n], [name]) for n in PREFILL_TOKENS]
        for n_req, n_tok in MULTI_CASES:
            multi_names = [None if mode == "none" else f"lora{i % NUM_ADAPTERS}" for i in range(n_req)]
            cases.append((f"prefill {n_req}x{n_tok}", [n_tok] * n_req, multi_names))
        if mode != "none":
            cases += [(f"prefill {n} (all base)", [n], [None]) for n in ALL_BASE_PREFILL]
        for label, lengths, names in cases:
            fb, req_rows, slots = prefill_batch(runner, lengths, names)
            for path, sets in graphs.items():
                use_prefill_graphs(runner, sets)
                expect = runner_takes_graph(runner, fb)
                ms = time_forward(runner, fb, expect, warmup, repeats)
                rows_out.append(dict(model=shape, lora=mode, case=label, path=path if expect or path == "eager"
                                     else f"{path}(eager fallback)", ms=round(ms, 3)))
                print(json.dumps(rows_out[-1]), flush=True)
            release(runner, req_rows, slots)
        use_prefill_graphs(runner, graphs["breakable"])
        decode_cases = [(f"decode bs{bs}", bs, name) for bs in DECODE_BS]
        if mode != "none":
            decode_cases += [(f"decode bs{bs} (all base)", bs, None) for bs in ALL_BASE_DECODE_BS]
        for label, bs, case_name in decode_cases:
            fb, req_rows, slots = decode_batch(runner, bs, case_name)
            for path, sets in (("eager", (None, None)), ("graph", decode_graphs)):
                use_decode_graphs(runner, sets)
                ms = time_forward(runner, fb, path == "graph", warmup, repeats)
                rows_out.append(dict(model=shape, lora=mode, case=label, path=path, ms=round(ms, 3)))
                print(json.dumps(rows_out[-1]), flush=True)
            release(runner, req_rows, slots)
        use_decode_graphs(runner, decode_graphs)
        del runner, graphs, decode_graphs
        gc.collect()
        torch.cuda.empty_cache()
    return rows_out


def to_markdown(rows: list[dict]) -> str:
    """One table per model: a row per case, a column per (LoRA mode, path); then the key ratios."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mrows = [r for r in rows if r["model"] == model]
        table = {(r["case"], r["lora"], r["path"].split("(")[0]): r for r in mrows}
        for group in ("prefill", "decode"):
            grows = [r for r in mrows if r["case"].startswith(group)]
            cols = list(dict.fromkeys((r["lora"], r["path"].split("(")[0]) for r in grows))
            cases = list(dict.fromkeys(r["case"] for r in grows))
            out.append(f"\n### {model}, {group} (ms, median)\n")
            out.append("| case | " + " | ".join(f"{lo}/{p}" for lo, p in cols) + " |")
            out.append("|---" * (len(cols) + 1) + "|")
            for case in cases:
                cells = []
                for lo, p in cols:
                    r = table.get((case, lo, p))
                    cells.append("" if r is None else f"{r['ms']:.2f}" + ("*" if "fallback" in r["path"] else ""))
                out.append(f"| {case} | " + " | ".join(cells) + " |")
        out.append("\n`*` = the graph refused the batch and it ran eagerly.\n")

        def ms(case, lora, path):
            r = table.get((case, lora, path))
            return r["ms"] if r else float("nan")

        for lo in ("triton", "csgmv"):
            for c in [f"prefill {n}" for n in PREFILL_TOKENS] + [f"prefill {n}x{t}" for n, t in MULTI_CASES]:
                out.append(
                    f"- {lo} {c}: LoRA breakable/eager = {ms(c, lo, 'breakable') / ms(c, lo, 'eager'):.2f}, "
                    f"LoRA breakable/base breakable = {ms(c, lo, 'breakable') / ms(c, 'none', 'breakable'):.2f}, "
                    f"LoRA full/eager = {ms(c, lo, 'full') / ms(c, lo, 'eager'):.2f}"
                )
            # All-base batches on the LoRA runner (graph set without LoRA) vs the runner without LoRA.
            for n in ALL_BASE_PREFILL:
                c = f"prefill {n}"
                out.append(f"- {lo} {c} all base / no-LoRA server: breakable = "
                           f"{ms(c + ' (all base)', lo, 'breakable') / ms(c, 'none', 'breakable'):.3f}, full = "
                           f"{ms(c + ' (all base)', lo, 'full') / ms(c, 'none', 'full'):.3f}")
            for bs in ALL_BASE_DECODE_BS:
                c = f"decode bs{bs}"
                out.append(f"- {lo} {c} all base / no-LoRA server: graph = "
                           f"{ms(c + ' (all base)', lo, 'graph') / ms(c, 'none', 'graph'):.3f}")
    return "\n".join(out) + "\n"


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(SHAPES))
    p.add_argument("--out", default=None, help="markdown file for the tables")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "sglang-bench-prefill-graph"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("this benchmark needs a CUDA device")
    rows = []
    for shape in args.models.split(","):
        rows += bench_model(shape.strip(), args.root, args.warmup, args.repeats)
    md = f"Device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}\n" + to_markdown(rows)
    print(md)
    if args.out:
        with open(args.out, "w") as f:
            f.write(md)


if __name__ == "__main__":
    main()
