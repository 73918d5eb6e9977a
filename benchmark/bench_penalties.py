"""What sampling penalties and logit biases cost a decode step (the twenty-third session's question:
fuse the adjustments into one kernel if they cost more than ~2% of a step).

One process, one GPU: for a batch of `--bs` requests over the vocabulary of `--model`'s shape, the
scheduler's sampling tail as served (`sampling_info_for` on real `Req`s, then the `Sampler`), each
step appending one token to every request as a decode step does, in these configurations:
  plain-greedy   no request adjusts or samples (the Sampler's argmax, no tensors built)
  plain-sample   temperature 0.7, top_p 0.9 (the filters, no adjustments)
  freq-pres      plain-sample + frequency_penalty 0.5, presence_penalty 0.3
  all-penalties  freq-pres + repetition_penalty 1.1 (also reads the prompt's tokens)
  logit-bias     plain-sample + a 300-token logit_bias per request
  min-tokens     plain-sample + min_new_tokens past the run (EOS held back every step)
and beside them the base decode step of the same shape and batch under its CUDA graph, so that
each tail's extra time reads as a share of a step measured in the same run. Host time is the
wall time of building the step's sampling info (what the scheduler does before the Sampler);
the tail is the wall time of build + Sampler with the device synchronised.

    python benchmark/bench_penalties.py --model qwen3-4b --bs 64 --out penalties.md

With --filter-compare, bench_sampler.py's table follows at the same batch and vocabulary: the
top-k / top-p filter through the full sort against the sort-free Triton kernel, side by side (the
tails above take whichever path SGLANG_FUSED_KERNELS picks: the kernel on CUDA by default).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import runner_lib  # noqa: E402
from sglang.srt.layers.sampler import Sampler  # noqa: E402
from sglang.srt.managers.io_struct import TokenizedGenerateReqInput  # noqa: E402
from sglang.srt.managers.req import Req  # noqa: E402
from sglang.srt.managers.schedule_batch import LogitContext, sampling_info_for  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

SAMPLE = {"temperature": 0.7, "top_p": 0.9}
CONFIGS: dict[str, dict[str, Any]] = {
    "plain-greedy": {"temperature": 0.0},
    "plain-sample": dict(SAMPLE),
    "freq-pres": {**SAMPLE, "frequency_penalty": 0.5, "presence_penalty": 0.3},
    "all-penalties": {**SAMPLE, "frequency_penalty": 0.5, "presence_penalty": 0.3, "repetition_penalty": 1.1},
    "logit-bias": {**SAMPLE, "logit_bias": None},  # filled per vocabulary below
    "min-tokens": {**SAMPLE, "min_new_tokens": 1_000_000, "max_new_tokens": 2_000_000},
}
PROMPT_LEN = 512


def make_reqs(bs: int, vocab: int, params: dict[str, Any], gen: torch.Generator) -> list[Req]:
    reqs = []
    for i in range(bs):
        p = dict(params)
        if "logit_bias" in p:
            tokens = torch.randperm(vocab, generator=gen)[:300].tolist()
            p["logit_bias"] = {str(t): float((t % 200) - 100) for t in tokens}
        p.setdefault("max_new_tokens", 1_000_000)
        sp = SamplingParams.from_dict(p)
        sp.verify(vocab)
        prompt = torch.randint(0, vocab, (PROMPT_LEN,), generator=gen).tolist()
        reqs.append(Req(TokenizedGenerateReqInput(rid=f"r{i}", input_ids=prompt, sampling_params=sp), i))
    return reqs


def time_tail(reqs: list[Req], ctx: LogitContext, sampler: Sampler, logits: torch.Tensor,
              warmup: int, repeats: int) -> tuple[float, float]:
    """(median tail ms, median host-build ms) over `repeats` steps after `warmup`."""
    tails, builds = [], []
    gen = torch.Generator().manual_seed(1)
    for step in range(warmup + repeats):
        new = torch.randint(0, logits.shape[1], (len(reqs),), generator=gen).tolist()
        for r, t in zip(reqs, new):
            r.output_ids.append(t)  # the previous step's token, as the scheduler appends it
        runner_lib.sync(logits.device)
        t0 = time.perf_counter()
        info = sampling_info_for(reqs, logits.device, logit_ctx=ctx)
        t1 = time.perf_counter()
        sampler(logits, info)
        runner_lib.sync(logits.device)
        t2 = time.perf_counter()
        if step >= warmup:
            tails.append((t2 - t0) * 1e3)
            builds.append((t1 - t0) * 1e3)
    return statistics.median(tails), statistics.median(builds)


def base_step_ms(model: str, bs: int, warmup: int, repeats: int) -> tuple[float, int]:
    """(the base decode step of `model`'s shape at batch `bs` in ms, the vocabulary size): CUDA
    graph on a GPU, eager elsewhere (a CPU run is a smoke test of this script), dummy weights."""
    with tempfile.TemporaryDirectory() as root:
        ckpt, _ = runner_lib.write_assets(root, model, 0)
        runner = runner_lib.build_runner(ckpt, None, {}, prefill_buckets=[], decode_buckets=[bs],
                                         max_running_requests=max(64, bs),
                                         **({} if torch.cuda.is_available() else {"attention_backend": "torch_native"}))
        fb, rows, slots = runner_lib.decode_batch(runner, bs, None)
        ms = runner_lib.time_forward(runner, fb, torch.cuda.is_available(), warmup, repeats)
        runner_lib.release(runner, rows, slots)
        vocab = runner.model_config.vocab_size
        del runner
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return ms, vocab


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-4b", choices=sorted(runner_lib.SHAPES))
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", default=None)
    ap.add_argument("--filter-compare", action="store_true", help="also bench_sampler.py's sort-vs-kernel table")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    step, vocab = base_step_ms(args.model, args.bs, args.warmup, args.repeats)
    sampler = Sampler()
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(args.bs, vocab, generator=gen).to(device) * 4
    rows = []
    for name in args.configs.split(","):
        ctx = LogitContext({vocab - 1}, vocab, device)
        reqs = make_reqs(args.bs, vocab, CONFIGS[name], gen)
        tail, build = time_tail(reqs, ctx, sampler, logits, args.warmup, args.repeats)
        rows.append((name, tail, build))
        print(f"{name}: tail {tail:.3f} ms, build {build:.3f} ms", flush=True)
    plain = dict((n, t) for n, t, _ in rows).get("plain-sample")
    lines = [
        f"### Sampling tail, {args.model} shape (vocab {vocab}), {args.bs} requests, "
        f"{torch.cuda.get_device_name(0) if device.type == 'cuda' else 'CPU'}, {time.strftime('%Y-%m-%d')}",
        "",
        f"Base decode step ({'CUDA graph' if device.type == 'cuda' else 'eager'}, batch {args.bs}): **{step:.3f} ms**. Tail = building the "
        "sampling info + the Sampler, device synchronised (median of "
        f"{args.repeats} steps); extra = tail - plain-sample's, as a share of the base step.",
        "",
        "| config | tail (ms) | host build (ms) | extra vs plain-sample (ms) | extra / base step |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, tail, build in rows:
        extra = tail - plain if plain is not None else float("nan")
        lines.append(f"| {name} | {tail:.3f} | {build:.3f} | {extra:+.3f} | {extra / step:+.1%} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.filter_compare:
        import bench_sampler

        extra = ["--bs", str(args.bs), "--vocab", str(vocab)]
        if device.type != "cuda":
            extra.append("--cpu-dry-run")  # the interpreter: a tiny shape of its own
        if args.out:
            extra += ["--out", os.path.splitext(args.out)[0] + "-filter.md"]
        bench_sampler.main(extra)


if __name__ == "__main__":
    main()
