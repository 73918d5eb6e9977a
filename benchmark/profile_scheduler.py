"""The scheduler's host time per decode step, outside the model's forward.

    python benchmark/profile_scheduler.py --device cpu --model tiny --bs 64          # on this CPU
    python benchmark/profile_scheduler.py --model qwen3-4b --bs 64                   # on a GPU (dummy weights)

The scheduler runs in this process on real pipes (what the server's scheduler process does) with
`--bs` greedy streaming requests. Once they all decode, it times each decode turn and the parts of
it that are not `ModelRunner.forward`: the batch preparation (KV slots, the ForwardBatch, the
sampling parameters), the output processing, the news built and sent. Without an overlap scheduler
all of that is GPU idle time in every decode step. The turn's wall minus the forward is the
scheduler's share; reading the news back (the tokenizer manager's side) is timed apart.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import sys
import tempfile
import time
from typing import Any, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import host_phases  # noqa: E402
import sglang.srt.managers.schedule_batch as schedule_batch  # noqa: E402
import sglang.srt.managers.scheduler as scheduler_module  # noqa: E402
from bench_util import emit_table  # noqa: E402
from runner_lib import SHAPES, write_assets  # noqa: E402
from sglang.srt.managers.io_struct import TokenizedGenerateReqInput  # noqa: E402
from sglang.srt.managers.scheduler import Scheduler  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from sglang.srt.server_configs import build_run_configs  # noqa: E402

# (owner, attribute, label): module functions by their module, methods on the scheduler instance.
MODULE_PHASES = [
    (schedule_batch, "build_decode_batch", "ForwardBatch built"),
    (schedule_batch, "sampling_info_for", "sampling parameters"),
    (scheduler_module, "build_output", "news built"),
]
SCHEDULER_PHASES = [("process_messages", "messages"), ("get_next_batch", "next batch chosen"),
                    ("process_decode", "outputs processed"), ("send", "news sent")]
LABELS = [label for *_, label in MODULE_PHASES] + [label for _, label in SCHEDULER_PHASES] + ["news read"]


def measure(model: str, bs: int, steps: int, device: str, root: str, overlap: bool = False) -> dict[str, float]:
    """Per decode turn µs of each phase, "forward", "turn" (the scheduler's whole turn) and
    "news read" (the receiving side). With `overlap` (--enable-overlap-schedule) the forward is
    launched and finished in different turns, and "turn" is what counts: a step per turn."""
    ckpt, _ = write_assets(root, model, num_adapters=0)
    extra: dict[str, Any] = {} if model == "tiny" else {"load_format": "dummy"}
    args = ServerArgs(model_path=ckpt, device=device, max_running_requests=bs, enable_overlap_schedule=overlap,
                      **extra)
    to_r, to_w = mp.Pipe(duplex=False)
    from_r, from_w = mp.Pipe(duplex=False)
    sched = Scheduler(build_run_configs(args).scheduler, to_r, from_w)
    for i in range(bs):
        sp = SamplingParams.from_dict({"max_new_tokens": steps + 32, "temperature": 0.0, "ignore_eos": True})
        to_w.send(TokenizedGenerateReqInput(rid=f"r{i}", input_ids=[5 + i % 50, 9, 13, 200, 7], sampling_params=sp,
                                            stream=True))
    def read_news() -> None:
        while from_r.poll(0):
            from_r.recv()

    def turn() -> None:
        sched.process_messages(block=False)
        sched.schedule_turn()

    for _ in range(8):  # admit, prefill, reach steady decode
        turn()
        read_news()
    if len(sched.running) != bs:
        raise RuntimeError(f"{len(sched.running)} of {bs} requests running; raise the pool or lower --bs")
    targets = [*MODULE_PHASES, *((sched, name, label) for name, label in SCHEDULER_PHASES),
               (sched.model_runner, "forward", "forward")]
    timers = host_phases.PhaseTimers(["turn", "forward", *LABELS])
    timed_turn, timed_read = timers.wrap("turn", turn), timers.wrap("news read", read_news)
    with host_phases.patched(targets, timers):
        for _ in range(steps):
            timed_turn()
            timed_read()
    return {label: total / steps * 1e6 for label, total in timers.totals.items()}


def main(argv: Optional[list[str]] = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-4b", choices=sorted(SHAPES))
    p.add_argument("--bs", type=int, nargs="+", default=[64])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "sglang-profile-scheduler"))
    p.add_argument("--overlap", action="store_true", help="also measure the turn with --enable-overlap-schedule")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    md = [f"### Scheduler host time per decode turn, {args.model}, {args.device} ({time.strftime('%Y-%m-%d')})", "",
          "| requests | turn | forward | turn − forward | " + " | ".join(label for *_, label in MODULE_PHASES)
          + " | " + " | ".join(label for _, label in SCHEDULER_PHASES) + " | news read |",
          "|---:|" + "---:|" * (3 + len(MODULE_PHASES) + len(SCHEDULER_PHASES) + 1)]
    overlapped = []
    for bs in args.bs:
        for overlap in ((False, True) if args.overlap else (False,)):
            t = measure(args.model, bs, args.steps, args.device, args.root, overlap)
            # Free this scheduler (its KV pool and graphs) before the next one sizes its pool from
            # the free memory.
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
            if overlap:
                overlapped.append((bs, t["turn"], ordinary))
                continue
            ordinary = t["turn"]
            md.append(f"| {bs} | {t['turn']:.0f} | {t['forward']:.0f} | **{t['turn'] - t['forward']:.0f}** | "
                      + " | ".join(f"{t[label]:.0f}" for label in LABELS) + " |")
    md += ["", "µs per decode turn, means over the measured turns; the phases nest (the ForwardBatch and "
           "the sampling parameters are built inside the turn, outside the forward)."]
    if overlapped:
        md.append("")
        md += [f"- overlap schedule, {bs} requests: turn {turn:.0f} µs against {base:.0f} ordinary "
               f"(**{base / turn:.2f}x** the decode steps per second)" for bs, turn, base in overlapped]
    emit_table(md, args.out)
    return "\n".join(md) + "\n"


if __name__ == "__main__":
    main()
