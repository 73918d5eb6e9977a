"""Prefill and decode latency with and without LoRA, eager vs breakable vs full CUDA graphs.

One process, configurations side by side on the same dummy weights (GPU only):

    python benchmark/lora/bench_prefill_graph.py --out results.md [--models qwen3-4b,llama-3.1-8b,qwen2.5-0.5b]

For each model shape, three ModelRunners are built in turn (no LoRA; LoRA with the triton backend;
LoRA with csgmv). Each captures breakable prefill graphs and decode graphs for the measured sizes,
and a full prefill graph runner is captured beside them on the same weights; the benchmark swaps the
runner's prefill path between eager, breakable and full and checks `used_cuda_graph` on every
measured forward, so a number is never silently an eager one. LoRA cases use one rank-16 adapter
on all seven modules (and four distinct adapters for the multi-request cases). Times are medians of
whole forwards (body + logits + sampling, i.e. what a request's TTFT pays), with the device
synchronised around each.
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
    time_forward,
    write_assets,
)
from sglang.srt.model_executor.cuda_graph_config import Backend  # noqa: E402
from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import PrefillCudaGraphRunner  # noqa: E402

SHAPES = ("qwen3-4b", "llama-3.1-8b", "qwen2.5-0.5b")
PREFILL_TOKENS = [16, 128, 512, 2048, 4096]
NUM_ADAPTERS = 4
# Multi-request prefills with NUM_ADAPTERS distinct adapters: requests x tokens each. 4 x 32 and
# 4 x 512 hold the same token counts as the 128- and 2048-token single-adapter cases.
MULTI_CASES = [(8, 128), (4, 32), (4, 512)]
DECODE_BS = [1, 8, 32]
LORA_MODES = ("none", "triton", "csgmv")


def runner_and_graphs(ckpt: str, lora_mode: str, adapters: dict[str, str]):
    runner = build_runner(
        ckpt, None if lora_mode == "none" else lora_mode, adapters,
        prefill_buckets=PREFILL_TOKENS + [n * t for n, t in MULTI_CASES], decode_buckets=DECODE_BS,
    )
    graphs = {"eager": None, "breakable": runner.prefill_graph_runner,
              "full": PrefillCudaGraphRunner(runner, Backend.FULL)}
    return runner, graphs


def bench_model(shape: str, root: str, warmup: int, repeats: int) -> list[dict]:
    ckpt, adapters = write_assets(root, shape, NUM_ADAPTERS)
    rows_out = []
    for mode in LORA_MODES:
        runner, graphs = runner_and_graphs(ckpt, mode, adapters)
        decode_graph = runner.decode_graph_runner
        name = None if mode == "none" else "lora0"
        cases = [(f"prefill {n}", [n], [name]) for n in PREFILL_TOKENS]
        for n_req, n_tok in MULTI_CASES:
            multi_names = [None if mode == "none" else f"lora{i % NUM_ADAPTERS}" for i in range(n_req)]
            cases.append((f"prefill {n_req}x{n_tok}", [n_tok] * n_req, multi_names))
        for label, lengths, names in cases:
            fb, req_rows, slots = prefill_batch(runner, lengths, names)
            for path, graph in graphs.items():
                runner.prefill_graph_runner = graph
                expect = graph is not None and graph.can_run_graph(fb)
                ms = time_forward(runner, fb, expect, warmup, repeats)
                rows_out.append(dict(model=shape, lora=mode, case=label, path=path if expect or path == "eager"
                                     else f"{path}(eager fallback)", ms=round(ms, 3)))
                print(json.dumps(rows_out[-1]), flush=True)
            release(runner, req_rows, slots)
        runner.prefill_graph_runner = graphs["breakable"]
        for bs in DECODE_BS:
            fb, req_rows, slots = decode_batch(runner, bs, name)
            for path, graph in (("eager", None), ("graph", decode_graph)):
                runner.decode_graph_runner = graph
                ms = time_forward(runner, fb, graph is not None, warmup, repeats)
                rows_out.append(dict(model=shape, lora=mode, case=f"decode bs{bs}", path=path, ms=round(ms, 3)))
                print(json.dumps(rows_out[-1]), flush=True)
            release(runner, req_rows, slots)
        runner.decode_graph_runner = decode_graph
        del runner, graphs, decode_graph
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
        for lo in ("triton", "csgmv"):
            def ms(case, lora, path):
                r = table.get((case, lora, path))
                return r["ms"] if r else float("nan")
            for c in [f"prefill {n}" for n in PREFILL_TOKENS] + [f"prefill {n}x{t}" for n, t in MULTI_CASES]:
                out.append(
                    f"- {lo} {c}: LoRA breakable/eager = {ms(c, lo, 'breakable') / ms(c, lo, 'eager'):.2f}, "
                    f"LoRA breakable/base breakable = {ms(c, lo, 'breakable') / ms(c, 'none', 'breakable'):.2f}, "
                    f"LoRA full/eager = {ms(c, lo, 'full') / ms(c, lo, 'eager'):.2f}"
                )
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
