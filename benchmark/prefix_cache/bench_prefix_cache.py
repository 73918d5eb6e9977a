"""Prefix cache on vs off, base model and 8 adapters, in one call (issue 12's measurement).

    python benchmark/prefix_cache/bench_prefix_cache.py --out prefix_cache.md      # GPU, ~4 min
    python benchmark/prefix_cache/bench_prefix_cache.py --dry-run --out /tmp/x.md  # CPU, tiny shapes

Two servers in turn on the same dummy weights (Qwen3-4B shape, triton attention, CUDA graphs at
their defaults, csgmv LoRA with 8 random rank-16 PEFT adapters on all seven modules at the real
shape, written by `sglang.srt.tools.demo.write_peft_adapter`): one with the prefix cache, one with
`--disable-radix-cache`. Both serve LoRA, so base and adapter runs differ only in the requests.
Each runs `bench_serving --dataset-name generated-shared-prefix` twice: base requests, then each
group on its own adapter (`--gsp-lora-per-group`); 16 groups x 16 requests, a 2,048-token system
prompt per group, 64-token questions, 32 output tokens, 64 requests in flight, the cache flushed
after the warm-up. Writes a markdown table: request throughput, mean TTFT and cache hit rate per
run, and the on/off ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any, Optional

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PYTHON_DIR = os.path.join(REPO, "python")
sys.path.insert(0, PYTHON_DIR)
sys.path.insert(0, os.path.join(REPO, "benchmark"))

from sglang import bench_serving  # noqa: E402
from server_lib import server_info, start_server, stop_server  # noqa: E402

FULL = dict(preset="qwen3-4b", adapters=8, rank=16, groups=16, per_group=16, system=2048, question=64, output=32,
            concurrency=64)
DRY = dict(preset="tiny", adapters=2, rank=4, groups=2, per_group=3, system=48, question=6, output=3,
           concurrency=4)


def write_assets(root: str, cfg: dict) -> tuple[str, dict[str, str]]:
    from sglang.srt.lora.lora_config import PEFT_PROJECTIONS
    from sglang.srt.tools.demo import DemoAdapterSpec, write_peft_adapter
    from sglang.srt.tools.make_checkpoint import make_checkpoint

    ckpt = os.path.join(root, cfg["preset"])
    if not os.path.exists(os.path.join(ckpt, "config.json")):
        make_checkpoint(ckpt, preset=cfg["preset"], with_weights=False)
    with open(os.path.join(ckpt, "config.json")) as f:
        config = json.load(f)
    adapters = {}
    for i in range(cfg["adapters"]):
        path = os.path.join(root, f"{cfg['preset']}-r{cfg['rank']}-lora{i}")
        if not os.path.exists(os.path.join(path, "adapter_config.json")):
            os.makedirs(path, exist_ok=True)
            spec = DemoAdapterSpec(f"lora{i}", cfg["rank"], 2 * cfg["rank"], PEFT_PROJECTIONS, 500 + i)
            write_peft_adapter(path, config, spec)
        adapters[f"lora{i}"] = path
    return ckpt, adapters


def server_args(ckpt: str, adapters: dict[str, str], rank: int, cache: bool, dry: bool, extra: list[str]) -> list[str]:
    args = ["--model-path", ckpt, "--load-format", "dummy", "--lora-paths", *[f"{n}={p}" for n, p in adapters.items()],
            "--max-loras-per-batch", str(len(adapters) + 1), "--max-lora-rank", str(rank),
            "--lora-target-modules", "all"]
    args += ["--device", "cpu", "--max-total-tokens", "4096"] if dry else ["--attention-backend", "triton"]
    if not cache:
        args.append("--disable-radix-cache")
    return args + extra


def run_bench(url: str, cfg: dict, adapters: Optional[list[str]]) -> dict[str, Any]:
    argv = ["--base-url", url, "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", str(cfg["groups"]),
            "--gsp-prompts-per-group", str(cfg["per_group"]), "--gsp-system-prompt-len", str(cfg["system"]),
            "--gsp-question-len", str(cfg["question"]), "--gsp-output-len", str(cfg["output"]),
            "--max-concurrency", str(cfg["concurrency"]), "--flush-cache", "--disable-tqdm", "--seed", "7"]
    if adapters:
        argv += ["--gsp-lora-per-group", "--lora-name", *adapters]
    return bench_serving.main(argv)


def table(results: dict[tuple[str, str], dict], cfg: dict, startup: dict[str, float]) -> str:
    lines = [
        f"Prefix cache on vs off: {cfg['preset']} shape, dummy weights, {cfg['groups']} groups x "
        f"{cfg['per_group']} requests, {cfg['system']}-token system prompt per group, {cfg['question']}-token "
        f"questions, {cfg['output']} output tokens, concurrency {cfg['concurrency']}; both servers serve "
        f"{cfg['adapters']} rank-{cfg['rank']} adapters (csgmv); the LoRA run gives each group its own adapter. "
        f"Start-up: cache on {startup.get('on', 0):.0f} s, off {startup.get('off', 0):.0f} s.",
        "",
        "| requests | cache | req/s | mean TTFT (ms) | cache hit rate | failed |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for workload in ("base", "lora"):
        for cache in ("off", "on"):
            r = results.get((workload, cache))
            if r is None:
                continue
            lines.append(f"| {workload} | {cache} | {r['request_throughput']:.2f} | {r['ttft_ms']['mean']:.1f} | "
                         f"{r['cache_hit_rate']:.3f} | {r['failed']} |")
        on, off = results.get((workload, "on")), results.get((workload, "off"))
        if on and off and off["request_throughput"] and on["ttft_ms"]["mean"]:
            lines.append(f"| {workload} | **on/off** | **{on['request_throughput'] / off['request_throughput']:.2f}x** | "
                         f"**{on['ttft_ms']['mean'] / off['ttft_ms']['mean']:.2f}x** | | |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="markdown table path")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny model and workload: checks the plumbing")
    p.add_argument("--port", type=int, default=31100)
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "sglang-prefix-bench"))
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--server-args", default="", help="more launch_server flags for both servers (one string)")
    args = p.parse_args(argv)
    cfg = DRY if args.dry_run else FULL
    os.makedirs(args.workdir, exist_ok=True)
    ckpt, adapters = write_assets(args.workdir, cfg)
    url = f"http://127.0.0.1:{args.port}"
    results: dict[tuple[str, str], dict] = {}
    startup: dict[str, float] = {}
    for cache in ("on", "off"):
        log = os.path.join(os.path.dirname(os.path.abspath(args.out)), f"prefix_cache_server_{cache}.log")
        flags = server_args(ckpt, adapters, cfg["rank"], cache == "on", args.dry_run, args.server_args.split())
        proc, startup[cache] = start_server(flags, args.port, log, args.startup_timeout)
        try:
            for workload, names in (("base", None), ("lora", list(adapters))):
                results[(workload, cache)] = run_bench(url, cfg, names)
                if cache == "on":
                    info = server_info(url)
                    print(f"[{workload}] prefix cache: {info['prefix_cache']}; graphs: {info['graph_stats']}")
        finally:
            stop_server(proc)
        with open(args.out, "w") as f:  # after each server, so a run cut short keeps what it measured
            f.write(table(results, cfg, startup))
    print(open(args.out).read())


if __name__ == "__main__":
    main()
