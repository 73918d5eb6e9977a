"""All-reduce cost under tensor parallelism: eager vs captured in a CUDA graph (NCCL, 2+ GPUs).

    PYTHONPATH=$PWD/python python benchmark/bench_tp_allreduce.py                 # 2 GPUs, NCCL
    PYTHONPATH=$PWD/python python benchmark/bench_tp_allreduce.py --device cpu    # gloo dry run

A decode step of a Llama-3.1-70B-shaped model all-reduces [bs, 8192] bf16 twice per layer (o_proj
and down_proj), 160 times per token: at batch 1 their latency, not their bytes, is what counts
against the 16.4 ms weight-read floor of tp 2. Each size is timed three ways: eager (one launch per
all-reduce), and `--per-graph` all-reduces captured in one CUDA graph with each capture error mode
(`global`, torch's default, and `thread_local`, which every graph of the engine uses since NCCL's
watchdog thread may query CUDA events during a capture); a mode whose capture fails is reported as
such. NVLink multicast is off, as in the
server.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import torch  # noqa: E402

from sglang.srt.distributed import RankSpec, disable_nvlink_multicast, init_tensor_parallel  # noqa: E402
from sglang.srt.utils import get_free_port  # noqa: E402


def _time(fn: Any, iters: int, cuda: bool) -> float:
    """Seconds per call of `fn` (after a warm-up call)."""
    fn()
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def _rank(rank: int, args: argparse.Namespace, port: int, out: Any) -> None:
    cuda = args.device == "cuda"
    spec = RankSpec(tp_rank=rank, tp_size=args.world_size, local_rank=rank, backend="nccl" if cuda else "gloo",
                    init_method=f"tcp://127.0.0.1:{port}", timeout_s=300)
    group = init_tensor_parallel(spec)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []
    for bs in args.batch_sizes:
        x = torch.randn(bs, args.hidden, device=device, dtype=dtype)
        row = {"bs": bs, "MB": x.numel() * x.element_size() / 1e6,
               "eager_us": _time(lambda: group.all_reduce(x), args.iters, cuda) * 1e6}
        for mode in (("global", "thread_local") if cuda else ()):
            try:
                graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(device)
                torch.cuda.synchronize()
                with torch.cuda.graph(graph, stream=stream, capture_error_mode=mode):
                    for _ in range(args.per_graph):
                        group.all_reduce(x)
                row[f"graph_{mode}_us"] = _time(graph.replay, max(1, args.iters // args.per_graph), cuda) \
                    * 1e6 / args.per_graph
            except Exception as e:  # noqa: BLE001 - reported: which mode captures NCCL is the finding
                row[f"graph_{mode}_us"] = f"capture failed: {type(e).__name__}: {str(e)[:80]}"
                torch.cuda.synchronize()
        rows.append(row)
    group.barrier()
    if rank == 0:
        out.put(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 128, 2048])
    p.add_argument("--iters", type=int, default=400)
    p.add_argument("--per-graph", type=int, default=160, help="all-reduces per captured graph (70B: 80 layers x 2)")
    args = p.parse_args()
    if args.device == "cpu":
        args.hidden, args.batch_sizes, args.iters = min(args.hidden, 256), [1, 4], min(args.iters, 20)
    disable_nvlink_multicast()  # inherited by the ranks
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), get_free_port()
    procs = [ctx.Process(target=_rank, args=(r, args, port, out)) for r in range(args.world_size)]
    for proc in procs:
        proc.start()
    rows = out.get(timeout=900)
    for proc in procs:
        proc.join(60)
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (gloo)"
    print(f"all-reduce over {args.world_size} ranks, {name}, hidden {args.hidden}")
    keys = [k for k in rows[0] if k not in ("bs", "MB")]
    print(f"{'bs':>6} {'MB':>8} " + " ".join(f"{k:>22}" for k in keys))
    for row in rows:
        cells = [f"{row[k]:>22.1f}" if isinstance(row[k], float) else f"{row[k]:>22}" for k in keys]
        print(f"{row['bs']:>6} {row['MB']:>8.3f} " + " ".join(cells))
    one = next((r for r in rows if r["bs"] == 1), None)
    if one is not None and isinstance(one.get("graph_thread_local_us"), float):
        print(f"70B decode at batch 1: 160 all-reduces = {one['graph_thread_local_us'] * 160 / 1e3:.2f} ms per token "
              "under the decode graph (floor: 16.4 ms of weight reads at tp 2)")


if __name__ == "__main__":
    main()
