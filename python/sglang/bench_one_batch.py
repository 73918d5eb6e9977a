"""Latency of one static batch, in process, through ModelRunner: a prefill, then decode steps.

    python -m sglang.bench_one_batch --model-path ./ckpt --load-format dummy \
        --batch-size 8 --input-len 512 --output-len 32 --warmup 2 --repeats 5

Every ServerArgs flag is accepted (attention backend, dtype, CUDA-graph flags, ...). Logs go to
stderr; the last line on stdout is one JSON object:
  {"batch_size", "input_len", "output_len", "prefill_ms", "decode_median_ms", "prefill_tok_s",
   "decode_tok_s", "total_ms", ...}
Latencies are medians over the repeats (decode: over every step of every repeat).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.model_executor.batch_builder import (
    DecodeRequest,
    ExtendRequest,
    build_decode_batch,
    build_extend_batch,
)
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.server_args import ServerArgs
from sglang.srt.server_configs import build_run_configs
from sglang.srt.utils import configure_logger

logger = logging.getLogger(__name__)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class RunTimes:
    prefill_s: float
    decode_s: list[float]  # one entry per decode step
    prefill_cuda_graph: bool
    decode_cuda_graph: Optional[bool]


def run_once(runner: ModelRunner, input_ids: list[list[int]], output_len: int) -> RunTimes:
    """One prefill of the whole batch and `output_len - 1` greedy decode steps. KV slots and
    request rows are freed afterwards."""
    bs, input_len = len(input_ids), len(input_ids[0])
    rows = runner.req_to_token_pool.alloc(bs)
    slots = runner.token_to_kv_pool_allocator.alloc(bs * (input_len + output_len))
    if rows is None or slots is None:
        raise ValueError(
            f"batch of {bs} x {input_len + output_len} tokens does not fit the KV cache "
            f"({runner.max_total_num_tokens} tokens) or request table ({runner.max_running_requests} rows); "
            "raise --max-total-tokens / --max-running-requests or shrink the batch"
        )
    try:
        span = input_len + output_len
        reqs = [
            ExtendRequest(rows[i], input_ids[i], 0, slots[i * span : i * span + input_len])
            for i in range(bs)
        ]
        _sync(runner.device)
        t0 = time.perf_counter()
        out = runner.forward(build_extend_batch(reqs, runner.req_to_token_pool, runner.device))
        _sync(runner.device)
        prefill_s = time.perf_counter() - t0
        prefill_graph, decode_graph = out.used_cuda_graph, None

        decode_s: list[float] = []
        next_ids = out.next_token_ids.tolist()
        for step in range(output_len - 1):
            seq_len = input_len + step + 1
            dreqs = [
                DecodeRequest(rows[i], next_ids[i], seq_len, int(slots[i * span + seq_len - 1]))
                for i in range(bs)
            ]
            _sync(runner.device)
            t0 = time.perf_counter()
            out = runner.forward(build_decode_batch(dreqs, runner.req_to_token_pool, runner.device))
            next_ids = out.next_token_ids.tolist()  # the host copy synchronises already
            decode_s.append(time.perf_counter() - t0)
            decode_graph = out.used_cuda_graph
        return RunTimes(prefill_s, decode_s, prefill_graph, decode_graph)
    finally:
        runner.token_to_kv_pool_allocator.free(slots)
        runner.req_to_token_pool.free(rows)


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m sglang.bench_one_batch", description=__doc__.split("\n\n")[0])
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    for flag in ("batch_size", "input_len", "output_len", "repeats"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    server_args = ServerArgs.from_cli_args(args)
    configure_logger(server_args.log_level, prefix=" bench")  # logs go to stderr

    runner = ModelRunner(build_run_configs(server_args).scheduler.runner)
    if args.input_len + args.output_len > runner.context_len:
        raise ValueError(
            f"--input-len + --output-len ({args.input_len + args.output_len}) exceeds the context "
            f"length {runner.context_len}"
        )
    gen = torch.Generator().manual_seed(server_args.random_seed)
    vocab = runner.model_config.vocab_size
    input_ids = torch.randint(0, vocab, (args.batch_size, args.input_len), generator=gen).tolist()

    for _ in range(args.warmup):
        run_once(runner, input_ids, args.output_len)
    prefill, decode, totals = [], [], []
    for _ in range(args.repeats):
        times = run_once(runner, input_ids, args.output_len)
        p, d = times.prefill_s, times.decode_s
        prefill.append(p)
        decode.extend(d)
        totals.append(p + sum(d))
        logger.info("prefill %.2f ms, decode median %.2f ms", p * 1e3, statistics.median(d) * 1e3 if d else 0.0)

    prefill_s = statistics.median(prefill)
    decode_s = statistics.median(decode) if decode else None
    result = {
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "prefill_ms": round(prefill_s * 1e3, 3),
        "decode_median_ms": round(decode_s * 1e3, 3) if decode_s else None,
        "prefill_tok_s": round(args.batch_size * args.input_len / prefill_s, 1),
        "decode_tok_s": round(args.batch_size / decode_s, 1) if decode_s else None,
        "total_ms": round(statistics.median(totals) * 1e3, 3),
        "model": runner.model_config.architecture,
        "dtype": str(runner.dtype).replace("torch.", ""),
        "device": torch.cuda.get_device_name(runner.device) if runner.device.type == "cuda" else "cpu",
        "attention_backend": server_args.resolved_attention_backend(),
        "load_format": server_args.load_format,
        "prefill_cuda_graph": times.prefill_cuda_graph,
        "decode_cuda_graph": times.decode_cuda_graph,
        "repeats": args.repeats,
    }
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
