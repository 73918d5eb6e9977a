"""The host build of a decode step's sampling info, on any machine (CPU included): what
`sampling_info_for` costs the scheduler per step, and, with --apply, what `LogitAdjustments.apply`
costs on the same device, for bench_penalties.py's configurations (its `make_reqs`) without its
model runner or CUDA graph.

Each step appends one token to every request (as a decode step does) and then builds the step's
sampling info; the time is the median over `--repeats` steps after `--warmup`.

    python benchmark/bench_sampling_build.py --bs 64 --vocab 151936 --repeats 300 --apply
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_penalties import CONFIGS, make_reqs  # noqa: E402
from sglang.srt.managers.schedule_batch import LogitContext, sampling_info_for  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_config(name: str, bs: int, vocab: int, device: torch.device, warmup: int, repeats: int,
                apply: bool) -> tuple[float, Optional[float]]:
    """(median build ms, median apply ms or None) for one configuration."""
    gen = torch.Generator().manual_seed(0)
    reqs = make_reqs(bs, vocab, CONFIGS[name], gen)
    ctx = LogitContext({vocab - 1}, vocab, device)
    logits = (torch.randn(bs, vocab, generator=gen) * 4).to(device)
    builds, applies = [], []
    for step in range(warmup + repeats):
        for r, t in zip(reqs, torch.randint(0, vocab, (bs,), generator=gen).tolist()):
            r.output_ids.append(t)
        sync(device)
        t0 = time.perf_counter()
        info = sampling_info_for(reqs, device, logit_ctx=ctx)
        t1 = time.perf_counter()
        if apply and info is not None and info.adjustments is not None:
            info.adjustments.apply(logits)
            sync(device)
            if step >= warmup:
                applies.append((time.perf_counter() - t1) * 1e3)
        if step >= warmup:
            builds.append((t1 - t0) * 1e3)
    return statistics.median(builds), (statistics.median(applies) if applies else None)


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--apply", action="store_true", help="also time LogitAdjustments.apply")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    print(f"| config | host build (ms) | apply (ms) |  bs {args.bs}, vocab {args.vocab}, {device.type}, "
          f"median of {args.repeats}")
    print("|---|---:|---:|")
    for name in args.configs.split(","):
        build, app = time_config(name, args.bs, args.vocab, device, args.warmup, args.repeats, args.apply)
        print(f"| {name} | {build:.3f} | {'-' if app is None else f'{app:.3f}'} |", flush=True)


if __name__ == "__main__":
    main()
