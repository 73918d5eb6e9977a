"""The Sampler's top-k / top-p filter: the full-row sort against the sort-free Triton threshold search.

    PYTHONPATH=$PWD/python python benchmark/bench_sampler.py [--bs 64] [--vocab 151936] [--out f.md]
    PYTHONPATH=$PWD/python python benchmark/bench_sampler.py --cpu-dry-run    # tiny shape, interpreter

benchmark/bench_penalties.py measured the sampling tail of 64 requests at temperature 0.7, top_p 0.9
over Qwen3's vocabulary at 2.18 ms on an H100 (0.08 ms greedy), the sort in `filter_probs` most of
it. Rows: for each filter setting, GPU µs per call under CUDA-graph replay of `filter_probs`
through the sort (`SGLANG_FUSED_KERNELS=torch`'s path) and through the kernel, then the whole
`Sampler` (softmax, filter, noise, argmax) both ways, then the kernel's launch configurations
(BLOCK, candidates per pass, warps) on the first setting. Last column: tokens whose kept / dropped
state differs from the sort's (0 on tie-free rows but for float-summation borderlines).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Callable, Optional

if "--cpu-dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402

from bench_util import add_output_args, emit_table, graph_us  # noqa: E402
from sglang.srt.layers.sampler import Sampler, filter_probs  # noqa: E402
import sglang.srt.layers.sampler as sampler_module  # noqa: E402

# The kernel path is the engine's default (SGLANG_SAMPLER_THRESHOLD_KERNEL=0 sorts); here
# fused_kernels() picks the path of each measurement.
sampler_module.THRESHOLD_KERNEL = True
from sglang.srt.layers.triton_ops.dispatch import fused_kernels  # noqa: E402
from sglang.srt.layers.triton_ops.topk_topp import topk_topp_threshold  # noqa: E402
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo  # noqa: E402

# (label, top_k, top_p) per request; bench_penalties' plain-sample is the first.
SETTINGS = [("top_p 0.9", -1, 0.9), ("top_k 50", 50, 1.0), ("top_k 50 + top_p 0.9", 50, 0.9), ("top_p 0.99", -1, 0.99)]
# (BLOCK, candidates per pass, warps): the default first. Keep [BLOCK, candidates] per thread small:
# (8192, 4, 16) and (4096, 8, 16) spill (4.4 / 6.7 ms on an H100).
CONFIGS = [(16384, 1, 16), (8192, 2, 16), (4096, 4, 16), (8192, 1, 16), (2048, 4, 8)]


def time_us(fn: Callable[[int], None], gpu: bool) -> float:
    if gpu:
        return graph_us(fn)
    # The dry run's timing is meaningless (the interpreter): one call, without a warm-up call,
    # runs the path once.
    t0 = time.perf_counter()
    fn(0)
    return (time.perf_counter() - t0) * 1e6


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--temperature", type=float, default=0.7)
    add_output_args(ap)
    args = ap.parse_args(argv)
    gpu = not args.cpu_dry_run
    device = "cuda" if gpu else "cpu"
    bs, vocab = (4, 999) if args.cpu_dry_run else (args.bs, args.vocab)
    configs = [(128, 16, 4), (256, 8, 4)] if args.cpu_dry_run else CONFIGS
    shape = "tiny" if args.cpu_dry_run else f"{bs} x {vocab}"

    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(bs, vocab, generator=gen) * 4).to(device)  # bench_penalties' logits
    probs = torch.softmax(logits / args.temperature, dim=-1)
    sampler = Sampler()
    lines = [
        f"### top-k / top-p filter, {bs} x {vocab}, temperature {args.temperature}, "
        f"{torch.cuda.get_device_name(0) if gpu else 'CPU (interpreter, timings meaningless)'}, {time.strftime('%Y-%m-%d')}",
        "",
        "| shape | what | setting | sort (µs) | kernel (µs) | sort / kernel | differing tokens |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for label, k, p in SETTINGS:
        info = SamplingBatchInfo.from_params([args.temperature] * bs, [p] * bs, [k] * bs, [0.0] * bs,
                                             [None] * bs, [0] * bs, device)
        with fused_kernels("torch"):
            ref = filter_probs(probs, info)
            sort_us = time_us(lambda i: filter_probs(probs, info), gpu)
            sort_sampler_us = time_us(lambda i: sampler(logits, info), gpu)
        with fused_kernels("triton"):
            got = filter_probs(probs, info)
            kernel_us = time_us(lambda i: filter_probs(probs, info), gpu)
            kernel_sampler_us = time_us(lambda i: sampler(logits, info), gpu)
        diff = int(((ref > 0) != (got > 0)).sum())
        lines.append(f"| {shape} | filter_probs | {label} | {sort_us:.1f} | {kernel_us:.1f} | "
                     f"{sort_us / kernel_us:.2f} | {diff} |")
        lines.append(f"| {shape} | Sampler | {label} | {sort_sampler_us:.1f} | {kernel_sampler_us:.1f} | "
                     f"{sort_sampler_us / kernel_sampler_us:.2f} | {diff} |")

    label, k, p = SETTINGS[0]
    top_ks = torch.full((bs,), k, dtype=torch.int64, device=device)
    top_ps = torch.full((bs,), p, dtype=torch.float32, device=device)
    with fused_kernels("torch"):
        info = SamplingBatchInfo.from_params([args.temperature] * bs, [p] * bs, [k] * bs, [0.0] * bs,
                                             [None] * bs, [0] * bs, device)
        ref = filter_probs(probs, info) > 0
    lines += ["", f"Kernel launch configurations ({label}; threshold + filtered write, µs):", "",
              "| shape | BLOCK | candidates | warps | kernel (µs) | differing tokens |", "|---|---:|---:|---:|---:|---:|"]
    out = torch.empty_like(probs)
    for block, n_cand, warps in configs:
        def run(i: int, block=block, n_cand=n_cand, warps=warps) -> None:
            topk_topp_threshold(probs, top_ks, top_ps, out=out, block=block, n_cand=n_cand, num_warps=warps)

        us = time_us(run, gpu)
        diff = int((ref != (out > 0)).sum())
        lines.append(f"| {shape} | {block} | {n_cand} | {warps} | {us:.1f} | {diff} |")
    emit_table(lines, args.out)


if __name__ == "__main__":
    main()
