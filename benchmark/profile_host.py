"""The host side of decode steps on the graphs: each phase's µs (host_phases.py) and cProfile's top
functions, base and LoRA, where the batch repeats and where it changes every step.

    python benchmark/profile_host.py --model qwen3-4b --bs 1 64 --adapters 8 --out host.md
    python benchmark/profile_host.py --device cpu --model tiny --bs 4 --repeats 5   # dry run (eager)

A decode step's host work (batch preparation, its copies, the graph launch, the eager tail's
launches) is GPU idle time in a step that waits for its result, as serving's does. For each batch
size: the base runner; the LoRA runner (rank-16 adapters, csgmv, `--adapters` in the pool, the
requests on them in turn) with the same batch every step ("same": consecutive decode steps of
unchanged requests, whose LoRA metadata is already in place) and with two batches of the same size
on different adapter orders in turn ("changing": every step rebuilds its metadata, as when requests
come and go). cProfile runs over the changing case and the base, top functions by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import host_phases  # noqa: E402
from bench_util import emit_table  # noqa: E402
from runner_lib import SHAPES, build_runner, decode_batch, forward_checked, release, write_assets  # noqa: E402


def top_functions(fn: Callable[[], Any], n: int, limit: int, device: Optional[torch.device]) -> str:
    """cProfile's `limit` top functions by own time over n calls of fn (each synchronised)."""
    prof = cProfile.Profile()
    for _ in range(n):
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        prof.enable()
        fn()
        prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(limit)
    lines = [ln for ln in out.getvalue().splitlines() if ln.strip()]
    start = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls"))
    return "\n".join(lines[start:])


def copy_latency(device: torch.device, n: int = 200) -> str:
    """Host µs of a small device-to-device copy_ (what load_tokens launches): the first after a
    synchronize, and a second right behind it. The base's load_tokens measured 102-111 µs and the
    LoRA runner's 48-57 for the same copy (H200, seventh session); the LoRA step makes CUDA calls
    before it, the base's makes none, so this tells whether the first call after the sync pays."""
    src = torch.arange(3 * 64, dtype=torch.int64, device=device)
    dst = torch.zeros(3, 80, dtype=torch.int64, device=device)[:, :64]
    first = second = 0.0
    for _ in range(n):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src.view(3, 64), non_blocking=True)
        t1 = time.perf_counter()
        dst.copy_(src.view(3, 64), non_blocking=True)
        second += time.perf_counter() - t1
        first += t1 - t0
    return (f"- a [3, 64] int64 device copy_: {first / n * 1e6:.1f} µs the first after a synchronize, "
            f"{second / n * 1e6:.1f} µs the next")


def main(argv: Optional[list[str]] = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-4b", choices=sorted(SHAPES))
    p.add_argument("--bs", type=int, nargs="+", default=[1, 64])
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "sglang-profile-host"))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    on_gpu = args.device == "cuda"
    t0 = time.perf_counter()
    ckpt, adapters = write_assets(args.root, args.model, num_adapters=args.adapters)
    overrides: dict[str, Any] = dict(max_running_requests=2 * max(64, *args.bs))  # two batches held at once
    if not on_gpu:
        overrides.update(device="cpu", dtype="float32", attention_backend="torch_native", disable_cuda_graph=True,
                         max_total_tokens=max(args.bs) * 2 * 300 + 1024)
    names = sorted(adapters)
    md = [f"### Host time of decode steps, {args.model}, "
          f"{torch.cuda.get_device_name(0) if on_gpu else 'CPU (dry run, eager)'}, torch {torch.__version__} "
          f"({time.strftime('%Y-%m-%d')})", ""]
    profiles = []
    for lora in (None, "csgmv"):
        runner = build_runner(ckpt, lora, adapters if lora else {}, prefill_buckets=[16], decode_buckets=args.bs,
                              **overrides)
        for bs in args.bs:
            if lora is None:
                fb, rows, slots = decode_batch(runner, bs, None)
                cases = {"base": [fb]}
                held = [(rows, slots)]
            else:
                fb_a, rows_a, slots_a = decode_batch(runner, bs, names)
                fb_b, rows_b, slots_b = decode_batch(runner, bs, names[1:] + names[:1])
                cases = {"LoRA, same batch": [fb_a], "LoRA, changing batch": [fb_a, fb_b]}
                held = [(rows_a, slots_a), (rows_b, slots_b)]
            for label, batches in cases.items():
                step = [0]

                def fwd(batches=batches, step=step):
                    fb = batches[step[0] % len(batches)]
                    step[0] += 1
                    return forward_checked(runner, fb, on_gpu)

                for _ in range(5):
                    fwd()
                phases = host_phases.measure(runner, fwd, args.repeats, runner.device)
                md.append(f"- bs {bs}, {label}: {host_phases.summary(phases)}")
                if label in ("base", "LoRA, changing batch"):
                    profiles.append((f"bs {bs}, {label}", top_functions(fwd, args.repeats, args.top,
                                                                        runner.device)))
            for rows, slots in held:
                release(runner, rows, slots)
        del runner
        if on_gpu:
            torch.cuda.empty_cache()
    if on_gpu:
        md += ["", copy_latency(torch.device("cuda"))]
    md += ["", f"cProfile, top {args.top} functions by own time over {args.repeats} steps:"]
    for label, text in profiles:
        md += ["", f"#### {label}", "", "```", text, "```"]
    md += ["", f"({time.perf_counter() - t0:.0f} s)"]
    emit_table(md, args.out)
    return "\n".join(md) + "\n"


if __name__ == "__main__":
    main()
