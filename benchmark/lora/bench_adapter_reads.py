"""Where a server's start-up with many adapters goes: adapter reads, and what runs beside the capture.

    PYTHONPATH=$PWD/python python benchmark/lora/bench_adapter_reads.py [--adapters 16] [--threads 1 8]
        [--shape qwen3-4b] [--rank 16] [--out reads.md]
    PYTHONPATH=$PWD/python python benchmark/lora/bench_adapter_reads.py --cpu-dry-run   # tiny shape

Part 1, reads: `--adapters` distinct rank-`--rank` PEFT adapters (float32, all seven projections,
written once) read the ways the engine can, each over all files,
in ms per adapter (wall / number of adapters) and MB/s of file bytes (runner_lib.write_assets
writes them):
  file bytes          the files' bytes read into one reused buffer per thread (the disk, or
                      the page cache: the files were just written)
  library             safetensors.torch.load_file alone (it maps the file; nothing is read yet)
  load                LoRAAdapter.load in the pool's dtype (bf16), unpinned (what a read beside
                      the capture does; pinned after)
  load pinned         the same, straight into pinned buffers (the start-up default on CUDA)
with 1 and `--threads` threads (each thread on one intra-op core, as at start-up).

Part 2, the capture's neighbours (CUDA only): a loop of short CUDA calls (a graph capture is
thousands of them, each giving up the GIL) timed alone, beside a thread running pure Python
(what an import is), and beside `--threads` adapter readers: how much a neighbour slows it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runner_lib

import torch  # noqa: E402

from runner_lib import write_assets  # noqa: E402
from sglang.srt.lora.lora import LoRAAdapter, LoRAModelShapes  # noqa: E402
from sglang.srt.lora.lora_config import LoRAConfig  # noqa: E402


def assets(root: str, shape: str, num: int, rank: int) -> tuple[LoRAModelShapes, list[LoRAConfig]]:
    """runner_lib's checkpoint and adapters (written once), as the shapes and configs a read needs."""
    ckpt, adapters = write_assets(root, shape, num, rank)
    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    shapes = LoRAModelShapes.from_hf_config(SimpleNamespace(**cfg))
    return shapes, [LoRAConfig.from_path(p, cfg["vocab_size"]) for p in adapters.values()]


def timed(fn, items, threads: int) -> float:
    """Wall seconds of fn over items with `threads` threads (each on one intra-op core)."""
    local = threading.local()

    def run(item):
        if not hasattr(local, "ready"):
            torch.set_num_threads(1)
            local.ready, local.buffer = True, bytearray()
        return fn(item, local.buffer)

    with ThreadPoolExecutor(threads) as pool:
        start = time.perf_counter()
        list(pool.map(run, items))
        return time.perf_counter() - start


def read_rows(shapes: LoRAModelShapes, configs: list[LoRAConfig], thread_counts: list[int]) -> list[tuple]:
    from safetensors.torch import load_file

    files = [os.path.join(c.path, "adapter_model.safetensors") for c in configs]
    mb = sum(os.path.getsize(f) for f in files) / 1e6
    pin = torch.cuda.is_available()

    def file_bytes(f, buf: bytearray):
        size = os.path.getsize(f)
        if len(buf) < size:
            buf.extend(bytes(size - len(buf)))
        with open(f, "rb") as fh:
            fh.readinto(memoryview(buf)[:size])

    ways = [
        ("file bytes", lambda f, buf: file_bytes(f, buf), files),
        ("library", lambda f, buf: load_file(f), files),
        ("load", lambda c, buf: LoRAAdapter.load("x", c, shapes, torch.bfloat16, pin=False), configs),
    ]
    if pin:
        ways.append(("load pinned", lambda c, buf: LoRAAdapter.load("x", c, shapes, torch.bfloat16, pin=True),
                     configs))
    rows = []
    timed(ways[0][1], files, 1)  # first pass: whatever the page cache lacks comes from the disk
    for threads in thread_counts:
        for name, fn, items in ways:
            s = timed(fn, items, threads)
            rows.append((name, threads, 1e3 * s / len(items), mb / s))
            print(f"[reads] {name:>14} {threads} thread(s): {1e3 * s / len(items):8.1f} ms/adapter "
                  f"{mb / s:8.0f} MB/s", file=sys.stderr, flush=True)
    return rows


def cuda_calls_s(calls: int) -> float:
    """Seconds of `calls` short CUDA calls (one tiny kernel each), synchronised every 100."""
    x = torch.zeros(16, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(calls):
        x.add_(1.0)
        if i % 100 == 99:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def neighbour_rows(shapes, configs, threads: int, calls: int) -> list[tuple[str, float]]:
    cuda_calls_s(calls // 10)  # warm up
    rows = [("alone", cuda_calls_s(calls))]
    stop = threading.Event()

    def python_work():
        while not stop.is_set():
            sum(i * i for i in range(10_000))

    t = threading.Thread(target=python_work)
    t.start()
    rows.append(("beside a pure-Python thread", cuda_calls_s(calls)))
    stop.set()
    t.join()
    reading = threading.Thread(target=timed, args=(
        lambda c, buf: LoRAAdapter.load("x", c, shapes, torch.bfloat16, pin=False), configs * 4, threads))
    reading.start()
    rows.append((f"beside {threads} adapter readers", cuda_calls_s(calls)))
    reading.join()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--adapters", type=int, default=16)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 8])
    p.add_argument("--shape", default="qwen3-4b")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--calls", type=int, default=20000, help="short CUDA calls timed in part 2")
    p.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "sglang-bench-reads"))
    p.add_argument("--out", default=None)
    p.add_argument("--cpu-dry-run", action="store_true", help="tiny shape, 2 adapters, part 1 only")
    args = p.parse_args()
    if args.cpu_dry_run:
        args.shape, args.adapters, args.threads = "tiny", 2, [1, 2]
    started = time.perf_counter()
    shapes, configs = assets(args.root, args.shape, args.adapters, args.rank)
    print(f"[reads] assets ready in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    rows = read_rows(shapes, configs, args.threads)
    mb = sum(os.path.getsize(os.path.join(c.path, "adapter_model.safetensors")) for c in configs) / 1e6 / len(configs)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    out = [f"### Adapter reads, {args.shape} rank {args.rank}, {len(configs)} float32 files of {mb:.0f} MB, "
           f"{device}, {os.cpu_count()} cores ({time.strftime('%Y-%m-%d')})", "",
           "| way | threads | ms per adapter | MB/s of files |", "|---|---:|---:|---:|"]
    out += [f"| {name} | {threads} | {ms:.1f} | {rate:.0f} |" for name, threads, ms, rate in rows]
    if torch.cuda.is_available() and not args.cpu_dry_run:
        neigh = neighbour_rows(shapes, configs, max(args.threads), args.calls)
        alone = neigh[0][1]
        out += ["", f"{args.calls} short CUDA calls (a capture's pattern), wall:", "",
                "| beside | s | vs alone |", "|---|---:|---:|"]
        out += [f"| {name} | {s:.2f} | {s / alone:.2f} |" for name, s in neigh]
    text = "\n".join(out) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
