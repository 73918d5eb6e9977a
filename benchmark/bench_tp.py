"""Tensor parallelism, measured (issue #13): tp 1 against tp 2, and a 70B-shaped server on 2 GPUs.

    PYTHONPATH=$PWD/python python benchmark/bench_tp.py --out tp.md                  # 2 GPUs
    PYTHONPATH=$PWD/python python benchmark/bench_tp.py --dry-run --out /tmp/tp.md   # CPU (gloo), tiny

Part `forward` (in process; one spawn of the ranks per tp size): the Llama-3.1-8B shape on dummy
weights, bf16, triton attention, one rank-16 csgmv adapter on all seven modules. For tp 1 and tp 2:
a prefill of 128 and of 2048 tokens (one request, breakable prefill graph) and a decode step at
batch 1 and 32 (256 tokens of context each, full decode graph), each without LoRA (the graph set
without LoRA kernels, as every all-base batch of a LoRA server) and with the adapter on every
request. Median ms per forward (body, eager tail and sampled-token broadcast) on rank 0.

Part `serve70b`: a Llama-3.1-70B-shaped server on 2 GPUs (`--tp-size 2`, dummy weights, csgmv, 4
rank-16 adapters, graphs on). Decode at batch 1 (`bench_serving`, concurrency 1, 128 -> 128
tokens), base and adapter requests: median inter-token latency against the weight-read floor (one
rank's weight bytes at 4.3 TB/s, ~16.4 ms); then `bench_serving` with the 4 adapters picked
uniformly (64 prompts of 512 -> 128 tokens, concurrency 16). Start-up time (launch to /health:
dummy init of 70 GB per GPU and the graph captures) is reported too.

Parts: `--parts forward serve70b` (default both). The dry run uses the tiny model on the CPU with
gloo ranks, eager, torch_native LoRA: plumbing only, its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "lora"))
sys.path.insert(0, os.path.join(ROOT, "test", "registered", "distributed"))

HBM_BYTES_PER_S = 4.3e12  # measured on an H200 (docs/h200-limits.md)
SERVE_PORT = 31270


# ---------------------------------------------------------------------------- part forward
def forward_rank(group: Any, ckpt: str, adapters: dict[str, str], opts: dict[str, Any]) -> list[dict[str, Any]]:
    """One rank's measurements (every rank runs the same forwards; rank 0's times are reported)."""
    from runner_lib import build_runner, decode_batch, prefill_batch, release, time_forward

    dry = opts["dry_run"]
    overrides = dict(device="cpu", dtype="float32", attention_backend="torch_native") if dry else {}
    runner = build_runner(ckpt, "torch_native" if dry else "csgmv", adapters, opts["prefill"], opts["decode_bs"],
                          tp_group=group, **overrides)
    graphs = not dry
    rows = []
    for lora in (None, "lora0"):
        for n in opts["prefill"]:
            fb, rows_, slots = prefill_batch(runner, [n], [lora])
            ms = time_forward(runner, fb, graphs, opts["warmup"], opts["repeats"])
            release(runner, rows_, slots)
            rows.append({"tp": group.size, "lora": lora is not None, "what": f"prefill {n}", "ms": ms})
        for bs in opts["decode_bs"]:
            fb, rows_, slots = decode_batch(runner, bs, lora, context=opts["context"])
            ms = time_forward(runner, fb, graphs, opts["warmup"], opts["repeats"])
            release(runner, rows_, slots)
            rows.append({"tp": group.size, "lora": lora is not None, "what": f"decode bs {bs}", "ms": ms})
    return rows


def part_forward(args: argparse.Namespace, root: str) -> str:
    from runner_lib import write_assets
    from tp_testlib import run_on_ranks

    shape = "tiny" if args.dry_run else "llama-3.1-8b"
    ckpt, adapters = write_assets(root, shape, 1)
    opts = {"dry_run": args.dry_run, "prefill": args.prefill, "decode_bs": args.decode_bs, "context": args.context,
            "warmup": args.warmup, "repeats": args.repeats}
    rows: list[dict[str, Any]] = []
    for tp in args.tp:
        start = time.perf_counter()
        rows += run_on_ranks(forward_rank, ckpt, adapters, opts, world_size=tp,
                             backend="gloo" if args.dry_run else "nccl", timeout=900)[0]
        print(f"[bench_tp] forward tp {tp}: {time.perf_counter() - start:.0f} s", flush=True)
    whats = [r["what"] for r in rows if r["tp"] == args.tp[0] and not r["lora"]]
    by_key = {(r["tp"], r["lora"], r["what"]): r["ms"] for r in rows}
    lines = [f"### {shape} shape, tp {' vs '.join(map(str, args.tp))}: ms per forward (rank 0, median)", "",
             "| LoRA | tp | " + " | ".join(whats) + " |", "|---|---:|" + "---:|" * len(whats)]
    for lora in (False, True):
        for tp in args.tp:
            cells = [f"{by_key[(tp, lora, w)]:.2f}" for w in whats]
            lines.append(f"| {'rank 16' if lora else 'none'} | {tp} | " + " | ".join(cells) + " |")
        if len(args.tp) > 1:
            first, last = args.tp[0], args.tp[-1]
            cells = [f"{by_key[(first, lora, w)] / by_key[(last, lora, w)]:.2f}x" for w in whats]
            lines.append(f"| {'rank 16' if lora else 'none'} | speed-up {last} vs {first} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- part serve70b
def weight_bytes_per_rank(config: dict[str, Any], tp: int) -> float:
    """Bytes of weights one rank reads per decode step (bf16): its shard of every linear layer and
    of the lm_head (the embedding is only looked up)."""
    h, layers, inter, vocab = config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"], \
        config["vocab_size"]
    head_dim = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    linear = layers * (h * (q + 2 * kv) + q * h + 2 * h * inter + inter * h)
    return 2 * (linear + vocab * h) / tp


def part_serve70b(args: argparse.Namespace, root: str) -> str:
    from bench_lora_serving import Config, launch
    from runner_lib import write_assets
    from server_lib import server_info, stop_server

    from sglang.bench_serving import main as bench_main

    shape = "tiny" if args.dry_run else "llama-3.1-70b"
    ckpt, adapters = write_assets(root, shape, 4)
    with open(os.path.join(ckpt, "config.json")) as f:
        config = json.load(f)
    server = ("--lora-backend", "csgmv", "--max-loras-per-batch", "4", "--max-lora-rank", "16", "--tp-size", "2",
              "--context-length", "1024" if args.dry_run else "4096", "--chunked-prefill-size", "2048",
              "--max-running-requests", "64",
              "--cuda-graph-bs-decode", "1", "2", "4", "8", "16", "--cuda-graph-bs-prefill", "512", "2048")
    log_path = os.path.join(args.log_dir, "server-70b-tp2.log")
    proc, startup = launch(ckpt, Config("tp2", server), adapters, SERVE_PORT, log_path, args.dry_run,
                           args.server_timeout)
    url = f"http://127.0.0.1:{SERVE_PORT}"
    try:
        info = server_info(url)
        common = ["--base-url", url, "--seed", "1", "--disable-tqdm"]
        bs1 = ["--num-prompts", "4", "--max-concurrency", "1", "--random-input-len", "128",
               "--random-output-len", str(args.bs1_output_len)]
        base1 = bench_main(common + bs1)
        lora1 = bench_main(common + bs1 + ["--lora-name", "lora0"])
        load = bench_main(common + ["--num-prompts", str(args.num_prompts), "--max-concurrency", "16",
                                    "--random-input-len", "512", "--random-output-len", "128",
                                    "--lora-name", *adapters])
    finally:
        stop_server(proc)
    floor_ms = weight_bytes_per_rank(config, 2) / HBM_BYTES_PER_S * 1e3
    graphs = info.get("graph_stats", {})
    lines = [f"### {shape} shape, --tp-size 2, csgmv, 4 rank-16 adapters, dummy weights", "",
             f"- start-up (launch to /health): {startup:.0f} s, {graphs.get('num_graphs', 0)} graphs captured in "
             f"{graphs.get('capture_seconds', 0.0):.0f} s",
             f"- weight-read floor per decode step: {weight_bytes_per_rank(config, 2) / 1e9:.1f} GB per GPU at "
             f"{HBM_BYTES_PER_S / 1e12:.1f} TB/s = **{floor_ms:.2f} ms**"]
    for name, res in (("base", base1), ("adapter lora0", lora1)):
        itl = res["itl_ms"]["median"]
        lines.append(f"- decode at batch 1, {name}: median ITL **{itl:.2f} ms** = {itl / floor_ms:.2f}x the floor "
                     f"(mean {res['itl_ms']['mean']:.2f}, p99 {res['itl_ms']['p99']:.2f}; {res['failed']} failed)")
    lines.append(f"- bench_serving, 4 adapters uniform, {load['num_prompts']} x 512 -> 128, concurrency 16: "
                 f"{load['request_throughput']:.2f} req/s, {load['output_throughput']:.0f} out tok/s, TTFT median "
                 f"{load['ttft_ms']['median']:.0f} ms, ITL median {load['itl_ms']['median']:.2f} ms, "
                 f"{load['failed']} failed")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- main
def main(argv: Optional[list[str]] = None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", choices=("forward", "serve70b"), default=["forward", "serve70b"])
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--prefill", type=int, nargs="+", default=[128, 2048])
    p.add_argument("--decode-bs", type=int, nargs="+", default=[1, 32])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--bs1-output-len", type=int, default=128)
    p.add_argument("--server-timeout", type=float, default=900)
    p.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "sglang-bench-tp"))
    p.add_argument("--log-dir", default=None)
    p.add_argument("--out", default=None, help="Also write the markdown here.")
    p.add_argument("--dry-run", action="store_true", help="CPU, gloo, tiny shapes (plumbing only)")
    args = p.parse_args(argv)
    if args.dry_run:
        args.prefill, args.decode_bs, args.context = [16, 64], [1, 4], 16
        args.warmup, args.repeats, args.num_prompts, args.bs1_output_len = 1, 2, 4, 4
        args.root += "-dry"
    args.log_dir = args.log_dir or os.path.join(args.root, "logs")
    os.makedirs(args.log_dir, exist_ok=True)
    from sglang.srt.distributed import disable_nvlink_multicast

    disable_nvlink_multicast()  # inherited by every rank and server process
    sections = []
    for part in args.parts:
        start = time.perf_counter()
        try:
            sections.append(part_forward(args, args.root) if part == "forward" else part_serve70b(args, args.root))
        except Exception as e:  # noqa: BLE001 - one failed part must not lose the other
            sections.append(f"### {part}: FAILED: {type(e).__name__}: {e}\n")
        print(f"[bench_tp] {part}: {time.perf_counter() - start:.0f} s", flush=True)
    text = "\n".join(sections)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return text


if __name__ == "__main__":
    main()
