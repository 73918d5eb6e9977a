"""The host build of a decode step's sampling info, on any machine (CPU included): what
`sampling_info_for` costs the scheduler per step, for bench_penalties.py's configurations (its
`make_reqs`) without its model runner or CUDA graph. Optional columns: --apply, what
`LogitAdjustments.apply` costs (device synchronised; the torch reference, as the CPU runs it);
--tail, build + the Sampler with the device synchronised (bench_penalties.py's "tail").

Each step appends one token to every request (as a decode step does) and then builds the step's
sampling info; times are medians over `--repeats` steps after `--warmup`. With --busy-ms on CUDA,
each build starts behind that much queued GPU work (the overlap schedule builds step N+1 while
step N runs): a build that waits for the device shows it.

    python benchmark/bench_sampling_build.py --bs 64 --vocab 151936 --repeats 300
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
from sglang.srt.layers.sampler import Sampler  # noqa: E402
from sglang.srt.managers.schedule_batch import LogitContext, sampling_info_for  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_config(name: str, bs: int, vocab: int, device: torch.device, warmup: int, repeats: int,
                apply: bool, tail: bool, busy_ms: float) -> dict[str, float]:
    """Median ms per step of "build", and of "apply" / "tail" when asked."""
    gen = torch.Generator().manual_seed(0)
    reqs = make_reqs(bs, vocab, CONFIGS[name], gen)
    ctx = LogitContext({vocab - 1}, vocab, device)
    logits = (torch.randn(bs, vocab, generator=gen) * 4).to(device)
    sampler = Sampler()
    busy_cycles = int(busy_ms * 1e6)  # ~1 GHz+ clocks: about busy_ms of GPU time, roughly
    times: dict[str, list[float]] = {"build": [], "apply": [], "tail": []}
    for step in range(warmup + repeats):
        for r, t in zip(reqs, torch.randint(0, vocab, (bs,), generator=gen).tolist()):
            r.output_ids.append(t)
        sync(device)
        if busy_cycles and device.type == "cuda":
            torch.cuda._sleep(busy_cycles)
        t0 = time.perf_counter()
        info = sampling_info_for(reqs, device, logit_ctx=ctx)
        t1 = time.perf_counter()
        keep = step >= warmup
        if keep:
            times["build"].append((t1 - t0) * 1e3)
        if apply and info is not None and info.adjustments is not None:
            sync(device)
            t2 = time.perf_counter()
            info.adjustments.apply(logits)
            sync(device)
            if keep:
                times["apply"].append((time.perf_counter() - t2) * 1e3)
        elif tail:
            sampler(logits, info)
            sync(device)
            if keep:
                times["tail"].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items() if v}


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--apply", action="store_true", help="also time LogitAdjustments.apply alone")
    ap.add_argument("--tail", action="store_true", help="also time build + Sampler (not with --apply)")
    ap.add_argument("--busy-ms", type=float, default=0.0, help="queued GPU work before each build (CUDA)")
    args = ap.parse_args(argv)
    if args.apply and args.tail:
        raise ValueError("--apply and --tail time different things: pick one")
    device = torch.device(args.device)
    extra = "apply" if args.apply else "tail" if args.tail else None
    print(f"bs {args.bs}, vocab {args.vocab}, {device.type}, median of {args.repeats} steps, busy {args.busy_ms} ms")
    print(f"| config | host build (ms) |{f' {extra} (ms) |' if extra else ''}")
    print(f"|---|---:|{'---:|' if extra else ''}")
    for name in args.configs.split(","):
        t = time_config(name, args.bs, args.vocab, device, args.warmup, args.repeats, args.apply, args.tail,
                        args.busy_ms)
        col = f" {t[extra]:.3f} |" if extra and extra in t else (" - |" if extra else "")
        print(f"| {name} | {t['build']:.3f} |{col}", flush=True)


if __name__ == "__main__":
    main()
