"""Online load generator for a running server: `python -m sglang.bench_serving [options]`.

Sends streaming `/generate` requests (`ignore_eos`, so every request produces exactly its output
length) with random prompts of the given lengths (token ids or text), from a JSONL file, or from
the generated shared-prefix dataset (`--dataset-name generated-shared-prefix`: groups of requests
sharing a system prompt, the prefix cache's workload), at a Poisson `--request-rate` and/or under a
`--max-concurrency` cap, and reports TTFT, inter-token latency and end-to-end latency (mean,
median, p99), input/output token throughput and the prefix-cache hit rate (cached prompt tokens
over prompt tokens). The last line printed is the result as JSON.

Multi-LoRA load: `--lora-name A B ...` gives each request one of the adapters, picked
`--lora-distribution uniform` or `zipf` (skewed popularity as in the S-LoRA and Punica
evaluations: the i-th name is picked with weight 1 / i^`--lora-zipf-alpha`); the picks depend on
`--seed` only, and the JSON reports how many requests each adapter got.

Uses aiohttp when it is installed, else a thread pool with `requests`. The requests themselves:
bench_workload.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from collections import Counter
from typing import Any, Iterable, Optional

from sglang.bench_workload import RequestSpec, arrival_times, build_requests
from sglang.sse import sse_lines

@dataclass
class RequestResult:
    ok: bool = False
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    latency: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""


# ---------------------------------------------------------------------------- senders
async def _run_aiohttp(url: str, specs: list[RequestSpec], times: list[float], headers: dict,
                       max_concurrency: Optional[int], bar: Any) -> tuple[list[RequestResult], float]:
    import aiohttp

    sem = asyncio.Semaphore(max_concurrency or len(specs))
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)

    async def one(session: Any, spec: RequestSpec, at: float, t0: float) -> RequestResult:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        async with sem:
            result = RequestResult()
            start = time.perf_counter()
            try:
                async with session.post(f"{url}/generate", json=spec.body, headers=headers) as resp:
                    if resp.status != 200:
                        result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    else:
                        lines = []
                        async for raw in resp.content:
                            line = raw.decode().strip()
                            if line:
                                lines.append((line, time.perf_counter()))
                        # Re-time from the arrival stamps recorded while streaming.
                        _consume_timed(lines, start, result)
            except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
                result.error = f"{type(e).__name__}: {e}"
            bar.update(1)
            return result

    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(session, s, at, t0) for s, at in zip(specs, times)))
        return list(results), time.perf_counter() - t0


def _consume_timed(lines: Iterable[tuple[str, float]], start: float, result: RequestResult) -> None:
    """Turn the SSE `data:` lines of one streamed /generate, each with its arrival time, into
    timings. Both senders stamp a line when it arrives, before any parsing."""
    last = None
    for line, stamp in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        data = json.loads(line[6:])
        if "error" in data:
            result.error = data["error"].get("message", "error")
            return
        if last is None:
            result.ttft = stamp - start
        else:
            result.itls.append(stamp - last)
        last = stamp
        result.prompt_tokens = data["meta_info"]["prompt_tokens"]
        result.completion_tokens = data["meta_info"]["completion_tokens"]
        result.cached_tokens = data["meta_info"].get("cached_tokens", 0)
    result.latency = (last or time.perf_counter()) - start
    result.ok = last is not None


def _run_threads(url: str, specs: list[RequestSpec], times: list[float], headers: dict,
                 max_concurrency: Optional[int], bar: Any) -> tuple[list[RequestResult], float]:
    import requests

    lock = threading.Lock()

    def one(spec: RequestSpec) -> RequestResult:
        result = RequestResult()
        start = time.perf_counter()
        try:
            with requests.post(f"{url}/generate", json=spec.body, headers=headers, stream=True, timeout=600) as resp:
                if resp.status_code != 200:
                    result.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                else:
                    stamped = ((line, time.perf_counter()) for line in sse_lines(resp))
                    _consume_timed(stamped, start, result)
        except Exception as e:  # noqa: BLE001
            result.error = f"{type(e).__name__}: {e}"
        with lock:
            bar.update(1)
        return result

    workers = max_concurrency or len(specs)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = []
        for spec, at in zip(specs, times):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            futures.append(pool.submit(one, spec))
        results = [f.result() for f in futures]
    return results, time.perf_counter() - t0


# ---------------------------------------------------------------------------- report
def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {"mean": statistics.fmean(values) * 1000, "median": statistics.median(values) * 1000, "p99": p99 * 1000}


def summarize(results: list[RequestResult], duration: float, args: argparse.Namespace, backend: str,
              specs: Optional[list[RequestSpec]] = None) -> dict:
    ok = [r for r in results if r.ok]
    inp = sum(r.prompt_tokens for r in ok)
    out = sum(r.completion_tokens for r in ok)
    lora: dict[str, Any] = {}
    if args.lora_name:
        counts = Counter(s.body.get("lora_path") for s in specs or [])
        # Results come back in the order of the specs: each request's adapter is its spec's.
        ttfts: dict[str, list[float]] = {name: [] for name in args.lora_name}
        for spec, r in zip(specs or [], results):
            if r.ok and spec.body.get("lora_path") in ttfts:
                ttfts[spec.body["lora_path"]].append(r.ttft)
        per_adapter = {name: _stats(v) for name, v in ttfts.items() if v}
        lora = {
            "lora_distribution": args.lora_distribution,
            "lora_zipf_alpha": args.lora_zipf_alpha if args.lora_distribution == "zipf" else None,
            # Requests sent per adapter, in --lora-name order.
            "lora_requests": {name: counts.get(name, 0) for name in args.lora_name},
            # TTFT per adapter (of its completed requests): starvation shows as one adapter's p99.
            "lora_ttft_ms": per_adapter,
            "worst_adapter_p99_ttft_ms": max((v["p99"] for v in per_adapter.values()), default=0.0),
        }
    cached = sum(r.cached_tokens for r in ok)
    return {
        "backend": backend,
        "num_prompts": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else None,  # None: all at once
        "max_concurrency": args.max_concurrency,
        "duration_s": duration,
        "total_input_tokens": inp,
        "total_output_tokens": out,
        "total_cached_tokens": cached,
        "cache_hit_rate": cached / inp if inp else 0.0,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "input_throughput": inp / duration if duration else 0.0,
        "output_throughput": out / duration if duration else 0.0,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "itl_ms": _stats([x for r in ok for x in r.itls]),
        "e2e_latency_ms": _stats([r.latency for r in ok]),
        **lora,
    }


def print_report(res: dict) -> None:
    line = "=" * 60
    print(line)
    print(f"{'Serving benchmark result':^60}")
    print(line)
    rows = [
        ("Backend", res["backend"]),
        ("Successful requests", res["completed"]),
        ("Failed requests", res["failed"]),
        ("Benchmark duration (s)", f"{res['duration_s']:.2f}"),
        ("Total input tokens", res["total_input_tokens"]),
        ("Total output tokens", res["total_output_tokens"]),
        ("Prefix cache hit rate", f"{res['cache_hit_rate']:.3f}"),
        ("Request throughput (req/s)", f"{res['request_throughput']:.2f}"),
        ("Input token throughput (tok/s)", f"{res['input_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{res['output_throughput']:.2f}"),
    ]
    for name, value in rows:
        print(f"{name:<40}{value:>20}")
    for key, title in (("ttft_ms", "Time to first token"), ("itl_ms", "Inter-token latency"),
                       ("e2e_latency_ms", "End-to-end latency")):
        print(f"{'-' * 18}{title:^24}{'-' * 18}")
        for stat in ("mean", "median", "p99"):
            print(f"{stat.capitalize() + ' (ms)':<40}{res[key][stat]:>20.2f}")
    if res.get("lora_requests"):
        counts = ", ".join(f"{k} {v}" for k, v in res["lora_requests"].items())
        print(f"{'LoRA requests (' + res['lora_distribution'] + ')':<40}{counts}")
        worst = max(res["lora_ttft_ms"].items(), key=lambda kv: kv[1]["p99"], default=None)
        if worst is not None:
            print(f"{'Worst adapter p99 TTFT (ms)':<40}{worst[1]['p99']:>20.2f} ({worst[0]})")
    for err in res["errors"]:
        print(f"error: {err}")
    print(line)


# ---------------------------------------------------------------------------- CLI
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sglang.bench_serving", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=None, help="Default: http://HOST:PORT.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--dataset-name", choices=("random", "generated-shared-prefix"), default="random",
                   help="random: --random-* lengths (or --dataset-path); generated-shared-prefix: "
                        "--gsp-num-groups x --gsp-prompts-per-group requests (--num-prompts is ignored).")
    p.add_argument("--gsp-num-groups", type=int, default=64)
    p.add_argument("--gsp-prompts-per-group", type=int, default=16)
    p.add_argument("--gsp-system-prompt-len", type=int, default=2048)
    p.add_argument("--gsp-question-len", type=int, default=128)
    p.add_argument("--gsp-output-len", type=int, default=256)
    p.add_argument("--gsp-range-ratio", type=float, default=1.0,
                   help="Question and output lengths are drawn per request from [ratio * len, len].")
    p.add_argument("--gsp-lora-per-group", action="store_true",
                   help="Serve group g with adapter --lora-name[g %% len] (the same adapter for a "
                        "whole group, as a tenant with its own fine-tune would).")
    p.add_argument("--flush-cache", action="store_true",
                   help="POST /flush_cache after the warm-up, so the run starts with an empty prefix cache.")
    p.add_argument("--dataset-path", default=None,
                   help="JSONL: one object per line with 'prompt'/'text' or 'input_ids', and optional 'output_len'.")
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=1.0,
                   help="Lengths are drawn uniformly from [ratio * len, len].")
    p.add_argument("--prompt-format", choices=("ids", "text"), default="ids")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Requests per second (Poisson).")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--lora-name", nargs="*", default=None, help="Adapters to pick from at random per request.")
    p.add_argument("--lora-distribution", choices=("uniform", "zipf"), default="uniform",
                   help="How often each --lora-name adapter is picked (zipf: the first is the most popular).")
    p.add_argument("--lora-zipf-alpha", type=float, default=1.0,
                   help="zipf skew: the i-th adapter is picked with weight 1 / i^alpha.")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--backend", choices=("auto", "aiohttp", "threads"), default="auto")
    p.add_argument("--output-file", default=None, help="Append the JSON result to this file.")
    args = p.parse_args(argv)
    if args.num_prompts < 1:
        p.error("--num-prompts must be >= 1")
    if args.request_rate <= 0:
        p.error("--request-rate must be > 0 (inf sends everything at once)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency must be >= 1")
    if not 0.0 < args.random_range_ratio <= 1.0:
        p.error("--random-range-ratio must be in (0, 1]")
    if args.lora_zipf_alpha <= 0:
        p.error("--lora-zipf-alpha must be > 0")
    if args.dataset_name == "generated-shared-prefix":
        if min(args.gsp_num_groups, args.gsp_prompts_per_group, args.gsp_question_len, args.gsp_output_len) < 1:
            p.error("--gsp-num-groups, --gsp-prompts-per-group, --gsp-question-len and --gsp-output-len must be >= 1")
        if args.gsp_system_prompt_len < 0 or not 0.0 < args.gsp_range_ratio <= 1.0:
            p.error("--gsp-system-prompt-len must be >= 0 and --gsp-range-ratio in (0, 1]")
        if args.gsp_lora_per_group and not args.lora_name:
            p.error("--gsp-lora-per-group needs --lora-name")
    return args


def main(argv: Optional[list[str]] = None) -> dict:
    import requests
    from tqdm import tqdm

    args = parse_args(argv)
    url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    info = requests.get(f"{url}/get_model_info", headers=headers, timeout=30)
    info.raise_for_status()
    vocab_size = int(info.json().get("vocab_size") or 32000)
    specs = build_requests(args, vocab_size)
    backend = args.backend
    if backend == "auto":
        try:
            import aiohttp  # noqa: F401

            backend = "aiohttp"
        except ImportError:
            backend = "threads"

    for spec in specs[: args.warmup_requests]:
        warm = dict(spec.body, sampling_params=dict(spec.body["sampling_params"], max_new_tokens=4))
        requests.post(f"{url}/generate", json=dict(warm, stream=False), headers=headers, timeout=600)
    if args.flush_cache:
        r = requests.post(f"{url}/flush_cache", headers=headers, timeout=600)
        if r.status_code != 200:
            raise SystemExit(f"/flush_cache failed: HTTP {r.status_code}: {r.text[:200]}")

    times = arrival_times(len(specs), args.request_rate, args.seed)
    with tqdm(total=len(specs), disable=args.disable_tqdm, file=sys.stderr, desc="requests") as bar:
        if backend == "aiohttp":
            results, duration = asyncio.run(_run_aiohttp(url, specs, times, headers, args.max_concurrency, bar))
        else:
            results, duration = _run_threads(url, specs, times, headers, args.max_concurrency, bar)
    res = summarize(results, duration, args, backend, specs)
    print_report(res)
    line = json.dumps(res, allow_nan=False)  # strict JSON: no Infinity / NaN for other parsers
    print(line)
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(line + "\n")
    return res


if __name__ == "__main__":
    main()
