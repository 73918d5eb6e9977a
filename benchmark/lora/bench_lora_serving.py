"""Multi-LoRA serving against the base model, as users run it: one load, several servers, one call.

    python benchmark/lora/bench_lora_serving.py --out lora_serving.md
    python benchmark/lora/bench_lora_serving.py --dry-run --out /tmp/dry.md     # CPU, tiny shapes

Every server serves the Qwen3-4B shape (config only, `--load-format dummy`), triton attention, the
default CUDA graphs; the LoRA servers get rank-16 adapters (8 unless said) on all seven modules
(written by `sglang.srt.tools.make_adapter`). Each load is `bench_serving` with the same seed, so
the same prompts and the same adapter per request: 256 prompts of 512 tokens -> 128, concurrency
64, adapters picked uniformly (or zipf). Configurations (`--configs`, in order):

    base          no LoRA
    csgmv         csgmv, 8 slots (one per adapter)      csgmv-zipf   the same server, zipf picks
    triton        triton, 8 slots                       triton-zipf  the same server, zipf picks
    csgmv-4       csgmv, 4 slots                        triton-4     triton, 4 slots
    csgmv-16      csgmv, 16 adapters on 16 slots        csgmv-r64    csgmv, 8 rank-64 adapters, 8 slots
    base-metrics  no LoRA, --enable-metrics, /metrics scraped every second during the load (against
                  `base`: what metrics cost)
    base-again    no LoRA, a second server (list it last): the spread of the base between servers
  Many adapters (more adapters than slots, zipf alpha 1 unless said; csgmv):
    z64-64        64 adapters on 64 slots               z64-16       64 adapters on 16 slots
    z256-64       256 adapters on 64 slots              u8-4         8 adapters, uniform, on 4 slots
    lora0-64      a LoRA server with 64 slots and no adapter at start, base requests (against
                  z64-64: what loading 64 adapters at start costs the start-up); lora0-64-again
                  the same server again (after another LoRA server: a warm kernel cache)
  --lora-fuse-norm (auto by default: the norms before every LoRA module, folded or not, since the
  eighth session): csgmv-fn and z64-64-fn (csgmv's and z64-64's servers with it on: the same
  fusions), csgmv-nofn (off); z64-64-fold
  (z64-64 with --lora-fold on: the fold crossover at 64 slots); z64-64-overlap (z64-64 with
  SGLANG_LORA_STARTUP_OVERLAP=1: its adapters read beside the graph capture, not before it).
  The overlap schedule (each decode step launched before the previous step's tokens reach the host)
  is on by default on a single GPU since the ninth session: base-serial and csgmv-serial are base's
  and csgmv's servers without it (--disable-overlap-schedule); base-overlap, csgmv-overlap and
  z64-64-overlap-schedule name it explicitly (the same servers as base, csgmv and z64-64 now).
  A prefill admitted while a decode step is in flight is queued behind it (the default since the
  eleventh session): base-pa, csgmv-pa and u8-4-pa are base's, csgmv's and u8-4's servers with
  SGLANG_OVERLAP_PREFILL=0 (that prefill runs apart, once the step is finished). csgmv-pu and
  z64-64-pu: csgmv's and z64-64's servers with SGLANG_LORA_PREFILL_UNFOLD=1 (folded modules run
  apart at prefill).
  The first LoRA server of a call also compiles the Triton kernels (a cold cache): its capture and
  start-up are the longer for it, so list a server whose start-up is not compared first.
  (Adapters beyond the first 32 reuse their files round-robin: the weights do not change a step's
  cost, and 256 rank-16 adapters of this shape would take 17 GB of disk; each name is its own
  adapter to the server, with its own host copy and slot.)

Each server first takes an unmeasured load of one wave (--warmup-prompts, other prompts, 4 output
tokens), so that kernels compile before the measured loads. Loads of one server configuration run
back to back on one server, each from an empty prefix cache (bench_serving --flush-cache after its
warm-up request: every load sends the same prompts), and the table names any load that still took
prompt tokens from the cache.

For each load the table has: request throughput and its ratio to the base's, mean / median TTFT,
mean ITL, the seconds the forwards took on the stream in prefill and in decode (every server runs
with SGLANG_FORWARD_TIMES=1), prefill batches that replayed a graph vs ran eagerly, the mean
running batch (decode requests per decode step), all from the change of /get_server_info over the
load; and per server its start-up time (launch to /health) with the graphs it captured and their
capture time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmark"))
from server_lib import server_info, start_server, stop_server  # noqa: E402

NUM_ADAPTERS = 8


@dataclass(frozen=True)
class Config:
    name: str
    server: tuple[str, ...]  # LoRA server args (empty: no LoRA)
    distribution: Optional[str] = "uniform"  # None: base requests only
    adapters: int = NUM_ADAPTERS
    rank: int = 16
    extra: tuple[str, ...] = ()  # other server args
    scrape_s: float = 0.0  # scrape /metrics this often during the load (0: never)
    env: tuple[tuple[str, str], ...] = ()  # the server's extra environment variables
    own_server: bool = False  # never shares a server with the configuration before it


def _lora(backend: str, slots: int) -> tuple[str, ...]:
    return ("--lora-backend", backend, "--max-loras-per-batch", str(slots))


CONFIGS = {
    "base": Config("base", (), None),
    # The base server once more, its own start (list it last): the spread between two base servers
    # of one call, against which the LoRA/base ratios are read.
    "base-again": Config("base-again", (), None, own_server=True),
    "csgmv": Config("csgmv", _lora("csgmv", NUM_ADAPTERS)),
    "csgmv-zipf": Config("csgmv-zipf", _lora("csgmv", NUM_ADAPTERS), "zipf"),
    "triton": Config("triton", _lora("triton", NUM_ADAPTERS)),
    "triton-zipf": Config("triton-zipf", _lora("triton", NUM_ADAPTERS), "zipf"),
    "csgmv-4": Config("csgmv-4", _lora("csgmv", 4)),
    "triton-4": Config("triton-4", _lora("triton", 4)),
    "csgmv-16": Config("csgmv-16", _lora("csgmv", 16), adapters=16),
    "csgmv-r64": Config("csgmv-r64", _lora("csgmv", NUM_ADAPTERS), rank=64),
    "base-metrics": Config("base-metrics", (), None, extra=("--enable-metrics",), scrape_s=1.0),
    # --enable-overlap-schedule: each decode step launched before the previous one's tokens reach
    # the host (managers/scheduler_overlap.py), base and LoRA.
    "base-overlap": Config("base-overlap", (), None, extra=("--enable-overlap-schedule",)),
    "base-serial": Config("base-serial", (), None, extra=("--disable-overlap-schedule",)),
    "csgmv-serial": Config("csgmv-serial", _lora("csgmv", NUM_ADAPTERS), extra=("--disable-overlap-schedule",)),
    "csgmv-overlap": Config("csgmv-overlap", _lora("csgmv", NUM_ADAPTERS), extra=("--enable-overlap-schedule",)),
    "z64-64-overlap-schedule": Config("z64-64-overlap-schedule", _lora("csgmv", 64), "zipf", adapters=64,
                                      extra=("--enable-overlap-schedule",)),
    "z64-64": Config("z64-64", _lora("csgmv", 64), "zipf", adapters=64),
    "z64-16": Config("z64-16", _lora("csgmv", 16), "zipf", adapters=64),
    "z256-64": Config("z256-64", _lora("csgmv", 64), "zipf", adapters=256),
    "u8-4": Config("u8-4", _lora("csgmv", 4)),
    "lora0-64": Config("lora0-64", _lora("csgmv", 64), None, adapters=0),
    # ... once more, later in the call: the first LoRA server of a call also compiles the kernels.
    "lora0-64-again": Config("lora0-64-again", _lora("csgmv", 64), None, adapters=0),
    # --lora-fuse-norm (issue 16): the norms compute the qkv / gate_up shrink at decode.
    "csgmv-fn": Config("csgmv-fn", _lora("csgmv", NUM_ADAPTERS), extra=("--lora-fuse-norm", "on")),
    "csgmv-nofn": Config("csgmv-nofn", _lora("csgmv", NUM_ADAPTERS), extra=("--lora-fuse-norm", "off")),
    "z64-64-fn": Config("z64-64-fn", _lora("csgmv", 64), "zipf", adapters=64, extra=("--lora-fuse-norm", "on")),
    # The fold crossover at many slots (issue 18): every module folded (W_aug carries all 64 slots'
    # B) against auto, which keeps qkv / gate_up unfolded at 64 slots of rank 16.
    "z64-64-fold": Config("z64-64-fold", _lora("csgmv", 64), "zipf", adapters=64, extra=("--lora-fold", "on")),
    # Start-up (issue 18): the 64 startup adapters read beside the graph capture, not before it;
    # its start-up against z64-64's is what the overlap saves (or costs).
    "z64-64-overlap": Config("z64-64-overlap", _lora("csgmv", 64), "zipf", adapters=64,
                             env=(("SGLANG_LORA_STARTUP_OVERLAP", "1"),)),
    # gate_up_proj's expand in the SiLU-and-mul (SGLANG_LORA_EXPAND_SILU, issues 16 / 18): at 64
    # slots gate_up_proj is unfolded, and its expand's read-modify-write of the output goes. The
    # default takes it at prefills from 1,024 tokens; -es at every batch, -no-es never.
    "z64-64-es": Config("z64-64-es", _lora("csgmv", 64), "zipf", adapters=64,
                        env=(("SGLANG_LORA_EXPAND_SILU", "1"),)),
    "z64-64-no-es": Config("z64-64-no-es", _lora("csgmv", 64), "zipf", adapters=64,
                           env=(("SGLANG_LORA_EXPAND_SILU", "0"),)),
    # SGLANG_OVERLAP_PREFILL=0: a prefill admitted while a decode step is in flight runs once that
    # step is finished, not queued behind it (managers/scheduler_overlap.py).
    "base-pa": Config("base-pa", (), None, env=(("SGLANG_OVERLAP_PREFILL", "0"),)),
    "csgmv-pa": Config("csgmv-pa", _lora("csgmv", NUM_ADAPTERS), env=(("SGLANG_OVERLAP_PREFILL", "0"),)),
    "u8-4-pa": Config("u8-4-pa", _lora("csgmv", 4), env=(("SGLANG_OVERLAP_PREFILL", "0"),)),
    # The base server with prefill graphs up to the chunk (8192 tokens, as a LoRA server's): by
    # default its set stops at 2048, so the wave's 8192-token prefills run eagerly. H200,
    # 2026-12-02: the same prefill seconds on the stream (1.64 / 1.64 s), req/s within the spread.
    "base-g8k": Config("base-g8k", (), None, extra=("--cuda-graph-max-bs-prefill", "8192")),
    # SGLANG_LORA_PREFILL_UNFOLD=1: csgmv's folded modules run apart at prefill (the base GEMM, the
    # chunked shrink and expand), decode keeps the fold (backend/chunked_backend.py).
    "csgmv-pu": Config("csgmv-pu", _lora("csgmv", NUM_ADAPTERS), env=(("SGLANG_LORA_PREFILL_UNFOLD", "1"),)),
    "z64-64-pu": Config("z64-64-pu", _lora("csgmv", 64), "zipf", adapters=64,
                        env=(("SGLANG_LORA_PREFILL_UNFOLD", "1"),)),
    # The default before 2026-12-05: shrink_pack copies x at prefill (SGLANG_LORA_PACK_IN_PLACE=0) and
    # the A-folded o_proj / down_proj keep shrink_pack there (SGLANG_LORA_AFOLD_PREFILL=0); -ip only the
    # latter. 2026-12-05 (H100): csgmv-copy 0.87 of the base's req/s, the default 0.88, mean TTFT -8.5%.
    "csgmv-copy": Config("csgmv-copy", _lora("csgmv", NUM_ADAPTERS),
                         env=(("SGLANG_LORA_PACK_IN_PLACE", "0"), ("SGLANG_LORA_AFOLD_PREFILL", "0"))),
    "csgmv-ip": Config("csgmv-ip", _lora("csgmv", NUM_ADAPTERS), env=(("SGLANG_LORA_AFOLD_PREFILL", "0"),)),
    # SGLANG_LORA_GEMM_SHRINK (triton_ops/gemm_shrink.py): the folded modules' shrink as one GEMM over
    # every slot's A at every prefill (-gs1; by default from buckets of 1,024 tokens), or never (-gs0:
    # shrink_pack, the default before 2026-12-05).
    "csgmv-gs1": Config("csgmv-gs1", _lora("csgmv", NUM_ADAPTERS), env=(("SGLANG_LORA_GEMM_SHRINK", "1"),)),
    "csgmv-gs0": Config("csgmv-gs0", _lora("csgmv", NUM_ADAPTERS), env=(("SGLANG_LORA_GEMM_SHRINK", "0"),)),
}
DISTINCT_ADAPTER_FILES = 32


@dataclass
class Row:
    config: Config
    result: dict[str, Any] = field(default_factory=dict)  # bench_serving's JSON
    delta: dict[str, float] = field(default_factory=dict)  # change of /get_server_info over the load
    server: dict[str, Any] = field(default_factory=dict)  # start-up time, graphs captured
    error: str = ""


# ---------------------------------------------------------------------------- assets and servers
def make_checkpoint_for(root: str, dry_run: bool) -> str:
    from sglang.srt.tools.make_checkpoint import make_checkpoint

    ckpt = os.path.join(root, "tiny" if dry_run else "qwen3-4b")
    if not os.path.exists(os.path.join(ckpt, "config.json")):
        if dry_run:
            make_checkpoint(ckpt, arch="qwen3", preset="tiny", with_weights=True)
        else:
            make_checkpoint(ckpt, arch="qwen3", preset="qwen3-4b", with_weights=False)
    return ckpt


def make_adapter_set(root: str, ckpt: str, num: int, rank: int) -> dict[str, str]:
    """`num` adapter names lora0.. for the checkpoint, on at most DISTINCT_ADAPTER_FILES rank-`rank`
    adapter folders (written once, then reused; names past them reuse the folders round-robin)."""
    from sglang.srt.tools.make_adapter import make_adapters

    files = min(num, DISTINCT_ADAPTER_FILES)
    adapters_dir = os.path.join(root, f"adapters-{os.path.basename(ckpt)}-r{rank}")
    paths = [os.path.join(adapters_dir, f"lora{i}") for i in range(files)]
    if not all(os.path.exists(os.path.join(p, "adapter_config.json")) for p in paths):
        paths = list(make_adapters(ckpt, adapters_dir, num=files, rank=rank, alpha=2 * rank, seed=100).values())
    return {f"lora{i}": paths[i % files] for i in range(num)}


def launch(ckpt: str, cfg: Config, adapters: dict[str, str], port: int, log_path: str, dry_run: bool,
           timeout: float) -> tuple[subprocess.Popen, float]:
    args = ["--model-path", ckpt, "--decode-log-interval", "200"]
    args += ["--device", "cpu", "--dtype", "float32"] if dry_run else ["--load-format", "dummy", "--attention-backend", "triton"]
    args += list(cfg.extra)
    if cfg.server:
        if adapters:
            args += ["--lora-paths", *[f"{n}={p}" for n, p in adapters.items()]]
        else:  # nothing to infer the pool's shape from: name it
            args += ["--enable-lora", "--max-lora-rank", str(cfg.rank), "--lora-target-modules", "all"]
        args += list(cfg.server)
        if dry_run:
            args[args.index("--lora-backend") + 1] = "torch_native"  # the Triton backends need a GPU
    # Every server times its forwards by phase (model_executor/forward_clock.py): the table's GPU
    # seconds in prefill and decode over the load.
    return start_server(args, port, log_path, timeout, env={"SGLANG_FORWARD_TIMES": "1", **dict(cfg.env)})


def counters(info: dict[str, Any]) -> dict[str, float]:
    graphs = info.get("graph_stats", {})
    out = {k: float(graphs.get(k, 0)) for k in ("prefill_graph_replays", "eager_prefills", "base_prefill_graph_replays",
                                                "decode_graph_replays", "eager_decodes", "lora_metadata_refreshes",
                                                "lora_metadata_writes")}
    for k in ("decode_steps", "decode_reqs", "prefill_batches", "prefill_tokens"):
        out[k] = float(info.get(k, 0))
    lora = info.get("lora") or {}
    for k in ("num_adapter_loads", "num_evictions", "num_prefetches"):
        out[k] = float(lora.get(k, 0))
    out["cached_tokens"] = float((info.get("prefix_cache") or {}).get("cached_tokens", 0))
    timed = info.get("forward_seconds") or {}
    for k in ("prefill_s", "decode_s"):
        out[k] = float(timed.get(k, 0.0))
    return out


class Scraper:
    """GET /metrics every `interval` seconds in a thread while the load runs (0: does nothing)."""

    def __init__(self, url: str, interval: float) -> None:
        self.url, self.interval, self.count = url, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import requests

        while not self._stop.wait(self.interval):
            r = requests.get(f"{self.url}/metrics", timeout=30)
            r.raise_for_status()
            self.count += 1

    def __enter__(self) -> "Scraper":
        if self.interval:
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self.interval:
            self._thread.join(60)


# ---------------------------------------------------------------------------- one load
def run_load(url: str, cfg: Config, adapters: dict[str, str], args: argparse.Namespace,
             warmup: bool = False) -> dict[str, Any]:
    """One bench_serving load; `warmup`: the unmeasured load before a server's first, with other
    prompts and 4 output tokens."""
    from sglang.bench_serving import main as bench_main

    prompts, output_len, seed = ((args.warmup_prompts, 4, args.seed + 1) if warmup
                                 else (args.num_prompts, args.output_len, args.seed))
    argv = ["--base-url", url, "--num-prompts", str(prompts), "--random-input-len", str(args.input_len),
            "--random-output-len", str(output_len), "--max-concurrency", str(args.concurrency),
            "--seed", str(seed), "--disable-tqdm",
            # Every load sends the same prompts (one seed): on a server shared with an earlier load
            # (or after the warm-up request) they would hit its prefix cache.
            "--flush-cache"]
    if cfg.distribution is not None:
        argv += ["--lora-name", *adapters, "--lora-distribution", cfg.distribution,
                 "--lora-zipf-alpha", str(args.zipf_alpha)]
    return bench_main(argv)


def bench_server(ckpt: str, configs: list[Config], args: argparse.Namespace, port: int) -> list[Row]:
    rows = [Row(cfg) for cfg in configs]
    adapters = (make_adapter_set(args.root, ckpt, configs[0].adapters, configs[0].rank)
                if configs[0].server and configs[0].adapters else {})
    log_path = os.path.join(args.log_dir, f"server-{configs[0].name}.log")
    try:
        proc, startup = launch(ckpt, configs[0], adapters, port, log_path, args.dry_run, args.server_timeout)
    except RuntimeError as e:
        for row in rows:
            row.error = str(e)
        return rows
    url = f"http://127.0.0.1:{port}"
    try:
        graphs = server_info(url).get("graph_stats", {})
        server = {"startup_s": startup, "num_graphs": graphs.get("num_graphs", 0),
                  "capture_s": graphs.get("capture_seconds", 0.0)}
        for i, row in enumerate(rows):
            row.server = server
            try:
                if i == 0 and args.warmup_prompts:
                    # Kernels the load's first full-size batches need (the eager prefills past the
                    # graph set, above all) compile here, not inside the first measured load: on
                    # the H200 (2026-12-02) a base server listed first spent 4.17 s in prefill
                    # forwards, the same server later in other calls 1.64-1.83 s.
                    run_load(url, row.config, adapters, args, warmup=True)
                before = counters(server_info(url))
                with Scraper(url, row.config.scrape_s) as scraper:
                    row.result = run_load(url, row.config, adapters, args)
                if row.config.scrape_s:
                    row.result["metrics_scrapes"] = scraper.count
                after = counters(server_info(url))
                row.delta = {k: after[k] - before[k] for k in after}
            except Exception as e:  # noqa: BLE001 - one failed load must not lose the others
                row.error = f"{type(e).__name__}: {e}"
    finally:
        stop_server(proc)
    return rows


# ---------------------------------------------------------------------------- the table
def to_markdown(rows: list[Row], header: str) -> str:
    base = next((r for r in rows if r.config.name == "base" and r.result), None)
    base_rps = base.result["request_throughput"] if base else None
    base_p99 = base.result["ttft_ms"]["p99"] if base else None
    lines = [header, "",
             "| server | req/s | vs base | mean TTFT (ms) | median TTFT (ms) | p99 TTFT (ms) | worst adapter p99 TTFT "
             "(x base p99) | mean ITL (ms) | forward s: prefill / decode | prefill graph / eager | mean running batch "
             "| adapter loads | start-up (s) | graphs (capture s) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.error or not r.result:
            lines.append(f"| {r.config.name} | failed: {r.error[:120]} |" + " |" * 12)
            continue
        res, d = r.result, r.delta
        rps = res["request_throughput"]
        ratio = f"{rps / base_rps:.2f}" if base_rps else "-"
        batch = d["decode_reqs"] / d["decode_steps"] if d.get("decode_steps") else 0.0
        graph = d["prefill_graph_replays"]
        worst = res.get("worst_adapter_p99_ttft_ms")
        worst_cell = "-" if worst is None else (f"{worst:.0f} ({worst / base_p99:.1f})" if base_p99 else f"{worst:.0f}")
        lines.append(
            f"| {r.config.name} | {rps:.1f} | {ratio} | {res['ttft_ms']['mean']:.0f} | {res['ttft_ms']['median']:.0f} "
            f"| {res['ttft_ms']['p99']:.0f} | {worst_cell} "
            f"| {res['itl_ms']['mean']:.1f} | {d.get('prefill_s', 0.0):.2f} / {d.get('decode_s', 0.0):.2f} "
            f"| {graph:.0f} / {d['eager_prefills']:.0f} | {batch:.1f} "
            f"| {d['num_adapter_loads']:.0f} | {r.server['startup_s']:.0f} "
            f"| {r.server['num_graphs']} ({r.server['capture_s']:.0f}) |"
        )
    cached = [r for r in rows if r.result and r.delta.get("cached_tokens", 0) > 0]
    if cached:  # random prompts share no prefix: a hit means a load reused an earlier load's cache
        lines.append("")
        lines += [f"- {r.config.name}: {r.delta['cached_tokens']:.0f} prompt tokens from the prefix cache" for r in cached]
    again = next((r for r in rows if r.config.name == "base-again" and r.result), None)
    if base_rps and again:
        rps = again.result["request_throughput"]
        lines += ["", f"- two base servers in this call: {base_rps:.1f} and {rps:.1f} req/s ({rps / base_rps:.2f}); "
                      "ratios to the base closer than that spread do not separate"]
    refreshed = [r for r in rows if r.result and r.delta.get("lora_metadata_refreshes")]
    if refreshed:
        lines.append("")
        lines += [f"- {r.config.name}: LoRA graph metadata written in {r.delta['lora_metadata_writes']:.0f} of "
                  f"{r.delta['lora_metadata_refreshes']:.0f} graph batches (the others found their batch in place)"
                  for r in refreshed]
    scraped = [r for r in rows if r.result and r.result.get("metrics_scrapes") is not None]
    if scraped:
        lines.append("")
        lines += [f"- {r.config.name}: /metrics scraped {r.result['metrics_scrapes']} times during the load" for r in scraped]
    failed = [r for r in rows if r.result and r.result.get("failed")]
    if failed:
        lines.append("")
        lines += [f"- {r.config.name}: {r.result['failed']} request(s) failed: {r.result['errors']}" for r in failed]
    return "\n".join(lines) + "\n"


def group_by_server(configs: list[Config]) -> list[list[Config]]:
    """Consecutive configurations with the same server args share one server."""
    groups: list[list[Config]] = []
    for cfg in configs:
        first = groups[-1][0] if groups else None
        same = (first.server, first.adapters, first.rank, first.extra, first.env) if first is not None else None
        if not cfg.own_server and same == (cfg.server, cfg.adapters, cfg.rank, cfg.extra, cfg.env):
            groups[-1].append(cfg)
        else:
            groups.append([cfg])
    return groups


def main(argv: Optional[list[str]] = None) -> list[Row]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="base,csgmv,csgmv-zipf,triton,triton-zipf,csgmv-16,csgmv-r64,base-again")
    p.add_argument("--out", default=None, help="markdown file for the table")
    p.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "sglang-bench-lora-serving"))
    p.add_argument("--log-dir", default=None, help="server logs and JSON results (default: --root)")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--zipf-alpha", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--port", type=int, default=31100)
    p.add_argument("--server-timeout", type=float, default=600)
    p.add_argument("--warmup-prompts", type=int, default=None,
                   help="prompts of the unmeasured load before each server's first (default: the "
                        "concurrency, one full wave; 0: none)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny checkpoint, a few short prompts")
    args = p.parse_args(argv)
    if args.dry_run:
        args.num_prompts, args.input_len, args.output_len, args.concurrency = 8, 16, 4, 4
    if args.warmup_prompts is None:
        args.warmup_prompts = args.concurrency
    args.log_dir = args.log_dir or args.root
    os.makedirs(args.log_dir, exist_ok=True)
    configs = [CONFIGS[name.strip()] for name in args.configs.split(",") if name.strip()]
    ckpt = make_checkpoint_for(args.root, args.dry_run)
    rows: list[Row] = []
    header = (f"`bench_serving`: {args.num_prompts} prompts of {args.input_len} tokens -> {args.output_len}, "
              f"concurrency {args.concurrency}, rank-16 adapters (8 unless the name says) on all seven modules, "
              f"zipf alpha {args.zipf_alpha}, after an unmeasured load of {args.warmup_prompts} prompts per server "
              f"({'tiny CPU dry run' if args.dry_run else 'Qwen3-4B shape, dummy weights, triton attention'}).")
    for i, group in enumerate(group_by_server(configs)):
        start = time.perf_counter()
        rows += bench_server(ckpt, group, args, args.port + i)
        print(f"[lora_serving] {'+'.join(c.name for c in group)}: {time.perf_counter() - start:.0f} s", flush=True)
        # After every server, so a run cut short keeps the servers it finished.
        md = to_markdown(rows, header)
        with open(os.path.join(args.log_dir, "lora_serving.json"), "w") as f:
            json.dump([dict(config=r.config.name, result=r.result, delta=r.delta, server=r.server, error=r.error)
                       for r in rows], f, indent=1)
        if args.out:
            with open(args.out, "w") as f:
                f.write(md)
    print(to_markdown(rows, header))
    return rows


if __name__ == "__main__":
    main()
