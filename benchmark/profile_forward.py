"""Where one forward's time goes: wall vs GPU-busy, kernels, torch ops, top kernels (issue #10).

    python benchmark/profile_forward.py --model llama-3.1-8b --out profile_8b.md
    python benchmark/profile_forward.py --model qwen3-4b --tokens 128 --no-hf-anchor
    python benchmark/profile_forward.py --device cpu --model tiny --tokens 16 --repeats 1   # dry run

For a model shape (dummy bf16 weights), with and without rank-16 LoRA adapters on all seven
projections (`--adapters N` loaded, N pool slots), for each path — eager, breakable prefill graph,
full prefill graph (one request of each `--tokens`; several requests with `--prefill-batches
4x512`, on the adapters in turn), decode graph (`--decode-bs`, 256 tokens of context; with LoRA,
for every `--decode-adapters k`, the requests take the first k adapters in turn; k is capped at the
batch's requests and the adapters loaded) — it reports:
  wall ms      median of whole forwards (body + logits + sampling + the copy to the host),
               synchronised around each; every wall of the process (all variants and rounds, the
               HF anchor's) is measured before the first profiler session, which slows the rest
               of its process down;
  host         each phase of the forward's host time (host_phases.py), with the walls;
  GPU busy ms  the union of kernel intervals per forward under torch.profiler (kernels inside
               graph replays included);
  kernels      kernels per forward, and per layer (per forward / layers, so the embedding and the
               eager tail are spread over the layers: an upper bound);
  torch ops    top-level aten ops per forward (the host work: eager bodies, replay copies, tail);
  top kernels  by GPU time per forward;
  LoRA kernels GPU µs per forward of the LoRA kernels, their launches and µs per launch.
Every measured forward checks that the intended path served it (`used_cuda_graph`). `--paths graph`
skips the eager and full-prefill paths. The summary gives LoRA / base for every case and path.

The anchor a user has (on by default when transformers is importable): HF transformers
`AutoModelForCausalLM.from_config` at the same shape, bf16, random weights,
`torch.compile(mode="reduce-overhead", dynamic=False)`, batch 1 x `--hf-tokens`, base and with a
PEFT LoRA of rank 16 on the seven projections, in the same run but a process of its own (its walls
first, then its profiles), before the engine's; its compile time is reported (the first calls of
each shape). HF computes the last position's logits only (`logits_to_keep=1`), like our engine, and
no KV cache (`use_cache=False`). Its own process: with the compiled HF models (CUDA graph trees of
`reduce-overhead`) alive in the engine's process, the engine's first profiled forward of the 8B
shape hit an illegal memory access on the H200 (2026-12-02; the walls before it were fine, and
the Qwen3-4B process without the anchor profiled fine in the same call).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import host_phases  # noqa: E402
from bench_util import module_knobs  # noqa: E402
from runner_lib import (  # noqa: E402
    SHAPES,
    build_runner,
    decode_batch,
    forward_checked,
    prefill_batch,
    release,
    sync,
    time_ms,
    write_assets,
)
from sglang.srt.lora.lora_config import PEFT_PROJECTIONS  # noqa: E402
from sglang.srt.configs.cuda_graph_config import Backend  # noqa: E402

TOP_KERNELS = 6
# The runner variants of --lora: (--lora-fuse-norm, SGLANG_LORA_ROWWISE_DECODE). lora is the default
# (auto: the norms before LoRA modules compute their shrink; o_proj's / down_proj's shrink row by
# row at decode batches of up to 16 rows); lora-segments is the default without the row-wise
# o_proj / down_proj; lora-fused (`on`: since the eighth session the same fusions as auto) without them; lora-rowwise runs o_proj's /
# down_proj's shrink row by row at every decode batch, lora-rowwise-small at up to 16 rows only,
# lora-rowwise-32 (the default's fusions) at up to 32.
LORA_VARIANTS = {
    "none": ("off", "0"),
    "lora": ("auto", "small"),
    "lora-segments": ("auto", "0"),
    "lora-unfused": ("off", "0"),
    "lora-fused": ("on", "0"),
    "lora-rowwise": ("on", "1"),
    "lora-rowwise-small": ("on", "small"),
    "lora-rowwise-32": ("auto", "rows:32"),  # the default's row-wise kernels up to 32 rows
    "lora-prefill-unfold": ("auto", "small"),  # the default, csgmv's folded modules apart at prefill
    "lora-late": ("auto", "small"),  # the default, its kernels captured with the early-start knobs off
    "lora-b-late": ("auto", "small"),  # the default, the unfolded expand loading B after the rank (the old order)
    "lora-no-afold": ("auto", "small"),  # the default without the A-fold (o_proj / down_proj keep their kernels)
    "lora-no-afold-expand": ("auto", "small"),  # the default, past the A-fold's bound shrink_pack and W_aug (csgmv)
    "lora-expand-pdl": ("auto", "small"),  # the default, csgmv's expand launched as a programmatic dependent
    # The default with csgmv's segments of 32 / 64 rows (--max-lora-chunk-size; 16 by default): fewer
    # reads of A at prefill, fewer programs.
    "lora-chunk-32": ("auto", "small"),
    "lora-chunk-64": ("auto", "small"),
    # The default without the A-fold at prefill (SGLANG_LORA_AFOLD_PREFILL=0): the norms / SiLU-and-mul
    # before folded modules still write into x_aug (SGLANG_LORA_PACK_IN_PLACE=1).
    "lora-pack-in-place": ("auto", "small"),
    # Neither (the default until 2026-12-05): shrink_pack copies x at prefill.
    "lora-copying": ("auto", "small"),
    # The default, RMSNorm releasing its programmatic dependents at its start (a folded module's
    # shrink_pack at prefill starts early).
    "lora-norm-release": ("auto", "small"),
    # Folded modules' shrink at prefill as one GEMM over every slot's A and a pack
    # (SGLANG_LORA_GEMM_SHRINK): at every prefill, or never (shrink_pack, the default before
    # 2026-12-05; the default now takes it from buckets of 1,024 tokens).
    "lora-gemm-shrink": ("auto", "small"),
    "lora-no-gemm-shrink": ("auto", "small"),
    # csgmv's unfolded modules (many slots) with the token backend's split-K shrink in place of the
    # chunked one (SGLANG_LORA_CSGMV_SPLIT_SHRINK=1).
    "lora-split-shrink": ("auto", "small"),
    # An unfolded gate_up_proj's expand in the SiLU-and-mul's kernel at every batch
    # (SGLANG_LORA_EXPAND_SILU=1, csgmv; triton_ops/expand_silu.py; the default takes it at
    # prefills from 1,024 tokens).
    "lora-expand-silu": ("auto", "small"),
    # The same with the fused kernel's column tile at 256 or 64 (EXPAND_SILU_TILES, 128 by default).
    "lora-expand-silu-256": ("auto", "small"),
    "lora-expand-silu-64": ("auto", "small"),
    # The default with qkv_proj A-folded at every prefill (SGLANG_LORA_AFOLD_QKV=1, csgmv; the
    # default takes it at prefills up to 1,024 tokens), and with it never (=0).
    "lora-afold-qkv": ("auto", "small"),
    "lora-no-afold-qkv": ("auto", "small"),
    # The default with the loads of 2026-12-06 in their old order: norm_shrink_pack's A tile and
    # scaling after the slot's rank (EARLY_LOADS off) and none-late-loads' two.
    "lora-late-loads": ("auto", "small"),
    # The default with norm_shrink_pack's norm weight loaded with the row too (NORM_WEIGHT_EARLY), and
    # without it (for a process that turned it on: SGLANG_LORA_NORM_WEIGHT_EARLY=1).
    "lora-norm-weight-early": ("auto", "small"),
    "lora-norm-weight-late": ("auto", "small"),
    # The default with cuBLAS's GEMM over all of W_aug at one-row decode batches, not fold_gemv
    # (SGLANG_LORA_FOLD_GEMV=0).
    "lora-no-fold-gemv": ("auto", "small"),
    # The default without the A-folded o_proj / down_proj's one-row GEMV: cuBLAS over [W; A of
    # every slot] (SGLANG_LORA_AFOLD_GEMV=0).
    "lora-no-afold-gemv": ("auto", "small"),
    # The base model with RMSNorm loading its weight after the row's reduction (rmsnorm.WEIGHT_FIRST
    # off) and the RoPE kernel its KV-cache slot before the store (rope.LOC_FIRST off).
    "none-late-loads": ("off", "0"),
    # The base model and the default LoRA with the linear layers' one-row GEMV (gemv.ONE_ROW_GEMV,
    # SGLANG_ONE_ROW_GEMV=1) in place of cuBLAS at decode batch 1.
    "none-gemv": ("off", "0"),
    "lora-gemv": ("auto", "small"),
}


def decode_adapter_counts(wanted: list[int], bs: int, loaded: int) -> list[int]:
    """The distinct adapters a decode batch of `bs` requests takes for each `--decode-adapters`
    count: at most one per request and the adapters loaded (so `--decode-bs 1,64 --decode-adapters
    8` measures 1 x 1 and 64 x 8), each count once, in order."""
    return sorted({min(k, bs, loaded) for k in wanted})


def is_base(lora: str) -> bool:
    """Whether a variant runs the base model (no LoRA): `none` and its knob variants."""
    return lora == "none" or lora.startswith("none-")
# Module constants that a variant's runner is built (and its graphs captured) with, against the
# default: (module path, name, value). lora-late: every early-start knob off (the norm kernel's
# PDL launch, the kernels before a LoRA shrink releasing it at their start).
VARIANT_KNOBS = {
    "lora-late": (("sglang.srt.lora.triton_ops.norm_shrink_pack", "PDL_MAX_ROWS", 0),
                  ("sglang.srt.layers.triton_ops.common", "RELEASE_DEPENDENTS", False)),
    "lora-b-late": (("sglang.srt.lora.triton_ops.sgemm_lora_b", "EXPAND_TILES", (256, 4)),),
    "lora-expand-pdl": (("sglang.srt.lora.triton_ops.sgemm_lora_b", "PDL_MAX_ROWS", 1 << 20),),
    "lora-norm-release": (("sglang.srt.layers.triton_ops.rmsnorm", "RELEASE_AT_START", True),),
    "lora-expand-silu-256": (("sglang.srt.lora.triton_ops.expand_silu", "EXPAND_SILU_TILES", (256, 4)),),
    "lora-expand-silu-64": (("sglang.srt.lora.triton_ops.expand_silu", "EXPAND_SILU_TILES", (64, 4)),),
    "lora-late-loads": (("sglang.srt.lora.triton_ops.norm_shrink_pack", "EARLY_LOADS", False),
                        ("sglang.srt.layers.triton_ops.rmsnorm", "WEIGHT_FIRST", False),
                        ("sglang.srt.layers.triton_ops.rope", "LOC_FIRST", False)),
    "lora-norm-weight-early": (("sglang.srt.lora.triton_ops.norm_shrink_pack", "NORM_WEIGHT_EARLY", True),),
    "lora-norm-weight-late": (("sglang.srt.lora.triton_ops.norm_shrink_pack", "NORM_WEIGHT_EARLY", False),),
    "none-late-loads": (("sglang.srt.layers.triton_ops.rmsnorm", "WEIGHT_FIRST", False),
                        ("sglang.srt.layers.triton_ops.rope", "LOC_FIRST", False)),
    "none-gemv": (("sglang.srt.layers.triton_ops.gemv", "ONE_ROW_GEMV", True),),
    "lora-gemv": (("sglang.srt.layers.triton_ops.gemv", "ONE_ROW_GEMV", True),),
}
# Server arguments a variant's runner is built with, over the default's.
VARIANT_ARGS = {"lora-chunk-32": {"max_lora_chunk_size": 32}, "lora-chunk-64": {"max_lora_chunk_size": 64}}
# Environment read when a variant's backend is built (backend/token_backend.py, chunked_backend.py):
# BASE_ENV for every variant (csgmv's prefill unfold off, whatever the caller's environment), then the
# variant's own; anything else keeps its default.
BASE_ENV = {"SGLANG_LORA_PREFILL_UNFOLD": "0", "SGLANG_LORA_PACK_IN_PLACE": "1", "SGLANG_LORA_AFOLD_PREFILL": "1",
            "SGLANG_LORA_FOLD_GEMV": "1", "SGLANG_LORA_AFOLD_GEMV": "1"}
VARIANT_ENV = {"lora-prefill-unfold": {"SGLANG_LORA_PREFILL_UNFOLD": "1"}, "lora-no-afold": {"SGLANG_LORA_AFOLD": "0"},
               "lora-no-afold-expand": {"SGLANG_LORA_AFOLD_EXPAND": "0"},
               "lora-pack-in-place": {"SGLANG_LORA_AFOLD_PREFILL": "0"},
               "lora-copying": {"SGLANG_LORA_PACK_IN_PLACE": "0", "SGLANG_LORA_AFOLD_PREFILL": "0"},
               "lora-gemm-shrink": {"SGLANG_LORA_GEMM_SHRINK": "1"},
               "lora-no-gemm-shrink": {"SGLANG_LORA_GEMM_SHRINK": "0"},
               "lora-split-shrink": {"SGLANG_LORA_CSGMV_SPLIT_SHRINK": "1"},
               "lora-expand-silu": {"SGLANG_LORA_EXPAND_SILU": "1"},
               "lora-expand-silu-256": {"SGLANG_LORA_EXPAND_SILU": "1"},
               "lora-expand-silu-64": {"SGLANG_LORA_EXPAND_SILU": "1"},
               "lora-afold-qkv": {"SGLANG_LORA_AFOLD_QKV": "1"},
               "lora-no-afold-qkv": {"SGLANG_LORA_AFOLD_QKV": "0"},
               "lora-no-fold-gemv": {"SGLANG_LORA_FOLD_GEMV": "0"},
               "lora-no-afold-gemv": {"SGLANG_LORA_AFOLD_GEMV": "0"}}
# The engine's LoRA kernels (triton_ops/): shrink_pack, the token-major and the chunked SGMV ones, and
# the row-wise norm_shrink_pack of --lora-fuse-norm (which also does the norm's work).
LORA_KERNELS = ("_shrink_pack_kernel", "_token_shrink_kernel", "_token_expand_kernel", "_segment_shrink_kernel",
                "_segment_expand_kernel", "_norm_shrink_pack_kernel", "_pack_all_slots_kernel",
                "_segment_expand_silu_kernel")


@dataclass
class Profile:
    busy_ms: float = 0.0
    kernels: float = 0.0
    copies: float = 0.0  # memcpy + memset per forward
    torch_ops: float = 0.0
    top: list[tuple[str, float, float]] = field(default_factory=list)  # (name, us per fwd, calls per fwd)
    lora_us: float = 0.0  # LoRA kernels' GPU µs per forward
    lora_launches: float = 0.0
    # Each LoRA kernel's (name, µs per forward, launches per forward), the costliest first.
    lora_by_kernel: list[tuple[str, float, float]] = field(default_factory=list)
    # GPU idle per forward before each kernel or copy (its start - the latest end before it), by
    # that kernel's name: (name, idle µs per fwd, calls per fwd). The entry whose calls are 1 per
    # forward and whose idle is largest is the host work before the forward's first launch.
    idle_before: list[tuple[str, float, float]] = field(default_factory=list)
    # Host µs per forward of each phase of ModelRunner.forward, measured without the profiler
    # (host_phases.py); empty for the HF anchor.
    host: dict[str, float] = field(default_factory=dict)


@dataclass
class Row:
    model: str
    lora: str
    case: str
    path: str
    wall_ms: float
    prof: Profile
    layers: int
    note: str = ""


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total / 1e3


def _is_top_level_op(evt) -> bool:
    parent = evt.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return False
        parent = parent.cpu_parent
    return True


def profile_fn(fn: Callable[[], Any], n: int) -> Profile:
    """Run `fn` n times under torch.profiler; per-forward GPU busy time, kernels and host ops."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sync()
    with profile(activities=activities) as prof:
        for _ in range(n):
            fn()
        sync()
    kernels, copies, intervals, ops, timeline = [], 0, [], 0, []
    for evt in prof.events():
        if evt.device_type == DeviceType.CUDA:
            timeline.append((evt.time_range.start, evt.time_range.end, evt.name))
            if evt.name.startswith(("Memcpy", "Memset")):
                copies += 1
            else:
                kernels.append(evt)
                intervals.append((evt.time_range.start, evt.time_range.end))
        elif evt.name.startswith("aten::") and _is_top_level_op(evt):
            ops += 1
    by_name: dict[str, list[float]] = {}
    for k in kernels:
        acc = by_name.setdefault(k.name, [0.0, 0])
        acc[0] += k.time_range.end - k.time_range.start
        acc[1] += 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
    lora = [v for name, v in by_name.items() if name.startswith(LORA_KERNELS)]
    lora_by_kernel = sorted(((name, us / n, calls / n) for name, (us, calls) in by_name.items()
                             if name.startswith(LORA_KERNELS)), key=lambda t: -t[1])
    return Profile(
        busy_ms=_union_ms(intervals) / n,
        kernels=len(kernels) / n,
        copies=copies / n,
        torch_ops=ops / n,
        top=[(name, us / n, calls / n) for name, (us, calls) in top],
        lora_us=sum(us for us, _ in lora) / n,
        lora_launches=sum(calls for _, calls in lora) / n,
        lora_by_kernel=lora_by_kernel,
        idle_before=_idle_before(timeline, n),
    )


def _idle_before(timeline: list[tuple[float, float, str]], n: int) -> list[tuple[str, float, float]]:
    """GPU idle before each device event (kernel, copy), summed by the event's name, per forward
    (the gap before the first event of the first forward is left out: it is the profiler's start)."""
    by_name: dict[str, list[float]] = {}
    latest = None
    for start, end, name in sorted(timeline):
        if latest is not None and start > latest:
            acc = by_name.setdefault(name, [0.0, 0])
            acc[0] += start - latest
            acc[1] += 1
        latest = end if latest is None else max(latest, end)
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS + 2]
    return [(name, us / n, calls / n) for name, (us, calls) in top]


# ------------------------------------------------------------------------------------ our engine
@dataclass
class EngineSetup:
    """One LoRA variant's runner and graphs, built once, measured in every round."""
    lora: str
    runner: Any
    graphs: dict[str, Any]
    decode_graph: Any
    names: list[Optional[str]]
    layers: int


def variant_knobs(lora: str) -> contextlib.AbstractContextManager:
    """The module constants of VARIANT_KNOBS[lora] set while the block runs, restored after."""
    knobs = VARIANT_KNOBS.get(lora, ())
    return module_knobs([(importlib.import_module(mod), name, value) for mod, name, value in knobs])


def build_setup(args, shape: str, ckpt: str, adapters: dict[str, str], lora: str) -> EngineSetup:
    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import PrefillCudaGraphRunner

    on_gpu = args.device == "cuda"
    t0 = time.perf_counter()
    overrides: dict[str, Any] = {}
    if not on_gpu:  # dry run: eager only, float32, the reference attention
        overrides = dict(device="cpu", dtype="float32", attention_backend="torch_native",
                         disable_cuda_graph=True, max_total_tokens=4096,
                         max_running_requests=max(8, *args.decode_bs))
    overrides.setdefault("max_running_requests", max(64, *args.decode_bs))
    if args.max_total_tokens is not None:
        overrides["max_total_tokens"] = args.max_total_tokens
    fuse_norm, rowwise = LORA_VARIANTS[lora]
    if not is_base(lora):
        overrides["lora_fuse_norm"] = fuse_norm
        overrides["lora_fold"] = args.lora_fold
        overrides.update(VARIANT_ARGS.get(lora, {}))
    os.environ["SGLANG_LORA_ROWWISE_DECODE"] = rowwise  # read when the backend is built
    env = {**BASE_ENV, **VARIANT_ENV.get(lora, {})}
    os.environ.update(env)
    buckets = sorted(set(args.tokens) | {sum(lens) for lens in args.prefill_batches})
    # Graphs keep the kernels as captured: the knobs need only hold while they are built.
    with variant_knobs(lora):
        runner = build_runner(ckpt, None if is_base(lora) else args.lora_backend, adapters,
                              prefill_buckets=buckets, decode_buckets=args.decode_bs, **overrides)
    os.environ.pop("SGLANG_LORA_ROWWISE_DECODE")
    for name in env:
        os.environ.pop(name)
    graphs: dict[str, Any] = {} if args.paths == "graph" else {"eager": None}
    if on_gpu:
        graphs["breakable"] = runner.prefill_graph_runner
        if args.paths != "graph":
            graphs["full"] = PrefillCudaGraphRunner(runner, Backend.FULL, capture_lora=not is_base(lora))
        if is_base(lora):  # base models only: compiled code cannot follow LoRA metadata
            for mode in args.tc_modes:
                t1 = time.perf_counter()
                graphs[f"tc_piecewise/{mode}"] = PrefillCudaGraphRunner(
                    runner, Backend.TC_PIECEWISE, capture_lora=False, compile_mode=mode)
                log(f"{shape}: tc_piecewise ({mode}) compiled and captured in {time.perf_counter() - t1:.1f}s")
    log(f"{shape} lora={lora}: runner and graphs ready in {time.perf_counter() - t0:.1f}s")
    names = [None] if is_base(lora) else sorted(adapters)
    return EngineSetup(lora, runner, graphs, runner.decode_graph_runner, names,
                       runner.model_config.num_hidden_layers)


# One case and path of a variant: (case, path, wall ms, profile or None, note).
Measured = tuple[str, str, float, Optional[Profile], str]


def _with_note(note: str, more: str) -> str:
    return f"{note}; {more}" if note else more


def measure_setup(args, setup: EngineSetup, mode: str, host: bool = False) -> list[Measured]:
    """Every case and path of one variant. mode "wall": each case's median wall (with `host`, also
    its host phases, in a Profile that holds only them); mode "profile": each case under
    torch.profiler, wall NaN. A process's walls must all come before its first profiler session:
    the profiler leaves CUPTI subscribed after it ends (PyTorch issue 144455), and on the H200 a
    decode graph's launch then took 160-450 µs of host time against 15-25 µs in a process never
    profiled (benchmark/profile_host.py), more for graphs with more nodes."""
    assert mode in ("wall", "profile"), mode
    runner, graphs, names, lora = setup.runner, setup.graphs, setup.names, setup.lora
    out: list[Measured] = []

    def measure(case: str, path: str, fb, expect_graph: bool, note: str = "") -> None:
        fwd = lambda: forward_checked(runner, fb, expect_graph)  # noqa: E731
        if mode == "profile":
            out.append((case, path, float("nan"), profile_fn(fwd, args.profile_repeats), note))
            return
        wall = time_ms(fwd, args.warmup, args.repeats, runner.device)
        prof = Profile(host=host_phases.measure(runner, fwd, args.repeats, runner.device)) if host else None
        out.append((case, path, wall, prof, note))
        log(f"  {lora:>12} {case:>12} {path:<10} wall {wall:8.3f} ms")

    prefills = [([n], f"prefill {n}") for n in args.tokens]
    prefills += [(lens, f"prefill {len(lens)}x{lens[0]}") for lens in args.prefill_batches]
    for lens, case in prefills:
        fb, req_rows, slots = prefill_batch(runner, lens, [names[i % len(names)] for i in range(len(lens))])
        for path, graph in graphs.items():
            runner.prefill_graph_runner = graph
            expect = graph is not None and graph.can_run(fb)
            measure(case, path, fb, expect, "" if expect or graph is None else "refused: eager")
        release(runner, req_rows, slots)
    runner.prefill_graph_runner = graphs.get("breakable")
    decode_graph = setup.decode_graph
    decode_paths = (("graph", decode_graph),) if args.paths == "graph" else (("eager", None), ("graph", decode_graph))
    for bs in args.decode_bs:
        for k in [1] if is_base(lora) else decode_adapter_counts(args.decode_adapters, bs, len(names)):
            fb, req_rows, slots = decode_batch(runner, bs, names[:k])
            for path, graph in decode_paths:
                if path == "graph" and graph is None:
                    continue
                runner.decode_graph_runner = graph
                measure(f"decode bs{bs}" + ("" if is_base(lora) else f" x{k}"), path, fb, graph is not None)
            release(runner, req_rows, slots)
    runner.decode_graph_runner = decode_graph
    return out


def engine_walls(args, shape: str, ckpt: str, adapters: dict[str, str]
                 ) -> tuple[list[EngineSetup], dict[str, list[list[Measured]]]]:
    """Every LoRA variant's runner, built first, then its walls at every case, the variants in
    turn round after round (A B C A B C ...): what drifts in a process over minutes (host state,
    clocks) then falls on every variant alike, not on whichever ran first. A wall time is the
    median of its rounds' medians; the host phases come from the first round."""
    setups = [build_setup(args, shape, ckpt, adapters, lora) for lora in args.lora]
    walls: dict[str, list[list[Measured]]] = {s.lora: [] for s in setups}
    for r in range(args.rounds):
        if args.rounds > 1:
            log(f"{shape}: round {r + 1} of {args.rounds}")
        for setup in setups:
            walls[setup.lora].append(measure_setup(args, setup, "wall", host=r == 0))
    return setups, walls


def engine_profiles(args, shape: str, setups: list[EngineSetup], walls: dict[str, list[list[Measured]]]) -> list[Row]:
    """The profiler pass over every variant and case (after every wall), and the rows."""
    rows: list[Row] = []
    log(f"{shape}: profiling every case (every wall is measured)")
    for setup in setups:
        profiles = measure_setup(args, setup, "profile")
        rows += _rows(shape, setup, walls[setup.lora], profiles)
    return rows


def _rows(shape: str, setup: EngineSetup, rounds: list[list[Measured]], profiles: list[Measured]) -> list[Row]:
    """One row per case and path: the profile pass's profile with the first round's host phases,
    the median of the rounds' walls."""
    rows = []
    for i, (case, path, _, host, note) in enumerate(rounds[0]):
        walls = [rnd[i][2] for rnd in rounds]
        assert all(rnd[i][:2] == (case, path) for rnd in rounds), "rounds measure the same cases in order"
        assert profiles[i][:2] == (case, path), "the profile pass measures the same cases in order"
        prof = profiles[i][3]
        prof.host = host.host
        if len(walls) > 1:
            note = _with_note(note, "rounds " + " / ".join(f"{w:.3f}" for w in walls))
        if torch.cuda.is_available() and prof.kernels < setup.layers:
            note = _with_note(note, "the profiler saw too few kernels: graph replays not traced?")
        rows.append(Row(shape, setup.lora, case, path, statistics.median(walls), prof, setup.layers, note))
    return rows


# ------------------------------------------------------------------------------------ HF anchor
@dataclass
class AnchorWall:
    """One HF anchor case measured for its wall, its compiled model kept for the profile pass."""
    row: Row
    fwd: Callable[[], Any]
    note: str


def hf_anchor_walls(args, shape: str, ckpt: str) -> list[AnchorWall]:
    """HF transformers + torch.compile at the same shape, base and with PEFT: compile, then the
    walls (before any profiler session, like the engine's); the models stay alive for
    hf_anchor_profiles."""
    from transformers import AutoConfig, AutoModelForCausalLM

    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    config = AutoConfig.from_pretrained(ckpt)
    out: list[AnchorWall] = []
    for lora in [x for x in args.lora if x in ("none", "lora")]:  # the engine's own variants have no HF twin
        t0 = time.perf_counter()
        torch.manual_seed(0)
        with device:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        label = "HF+compile"
        if lora != "none":
            from peft import LoraConfig, get_peft_model

            peft_cfg = LoraConfig(r=16, lora_alpha=32, target_modules=list(PEFT_PROJECTIONS),
                                  lora_dropout=0.0, init_lora_weights=False)
            model = get_peft_model(model, peft_cfg).eval()
            label = "HF+compile+PEFT"
        compiled = torch.compile(model, mode=args.hf_compile_mode, dynamic=False, backend=args.hf_compile_backend)
        log(f"{shape} HF lora={lora}: model built in {time.perf_counter() - t0:.1f}s")
        for n in args.hf_tokens:
            ids = torch.randint(10, min(1000, config.vocab_size), (1, n), device=device)

            @torch.no_grad()
            def fwd(compiled=compiled, ids=ids):
                return compiled(input_ids=ids, use_cache=False, logits_to_keep=1).logits

            t1 = time.perf_counter()
            for _ in range(3):  # compile, then CUDA-graph recording (reduce-overhead)
                fwd()
            sync()
            compile_s = time.perf_counter() - t1
            wall = time_ms(fwd, args.warmup, args.repeats)
            row = Row(shape, lora, f"prefill {n}", label, wall, Profile(), config.num_hidden_layers,
                      f"compile+warm-up {compile_s:.0f}s")
            out.append(AnchorWall(row, fwd, f"{label} {n} tokens: first three calls (compile, graph recording) "
                                            f"{compile_s:.1f} s"))
            log(f"  {label} {n:>5}: wall {wall:.3f} ms (compile {compile_s:.1f}s)")
    return out


def hf_anchor_profiles(args, walls: list[AnchorWall]) -> tuple[list[Row], list[str]]:
    """The anchor's profiler pass (after every wall of the process); then its models are freed."""
    rows, notes = [], []
    log("HF anchor: profiling every case")
    for w in walls:
        w.row.prof = profile_fn(w.fwd, args.profile_repeats)
        rows.append(w.row)
        notes.append(w.note)
    walls.clear()
    gc.collect()
    torch._dynamo.reset()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return rows, notes


def hf_anchor_in_own_process(argv: list[str]) -> tuple[list[Row], list[str]]:
    """The anchor measured by a child process of this script (`--anchor-only`), its rows read back:
    no compiled HF model and no profiler session of its ever shares the engine's process."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "anchor.json")
        subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--anchor-only", path], check=True)
        with open(path) as f:
            data = json.load(f)
    rows = [Row(**{**r, "prof": Profile(**r["prof"])}) for r in data["rows"]]
    return rows, data["notes"]


# ------------------------------------------------------------------------------------ report
def to_markdown(rows: list[Row], notes: list[str], tc_modes: tuple[str, ...] = ()) -> str:
    out = [
        "| model | LoRA | case | path | wall ms | GPU busy ms | wall − busy | wall / busy | kernels/fwd "
        "| kernels/layer | torch ops/fwd | memcpy+set/fwd |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        p = r.prof
        ratio = f"{r.wall_ms / p.busy_ms:.2f}" if p.busy_ms > 0 else "—"
        out.append(
            f"| {r.model} | {r.lora} | {r.case} | {r.path}{' (' + r.note + ')' if r.note else ''} | {r.wall_ms:.3f} "
            f"| {p.busy_ms:.3f} | {r.wall_ms - p.busy_ms:.3f} | {ratio} | {p.kernels:.0f} | {p.kernels / r.layers:.1f} "
            f"| {p.torch_ops:.0f} | {p.copies:.0f} |"
        )
    table = {(r.model, r.lora, r.case, r.path): r for r in rows}
    ratios = []
    for r in rows:
        if not r.path.startswith("HF"):
            continue
        for path in ("breakable", "full", *(f"tc_piecewise/{m}" for m in tc_modes), "eager"):
            ours = table.get((r.model, r.lora, r.case, path))
            if ours is not None:
                ratios.append(f"- {r.model} {r.lora} {r.case}: ours {path} / {r.path} = "
                              f"{ours.wall_ms:.3f} / {r.wall_ms:.3f} = **{ours.wall_ms / r.wall_ms:.2f}**")
    if ratios:
        out += ["", "Against the anchor (wall):", *ratios]
    vs_base = []
    for r in rows:
        if r.lora == "none" or r.path.startswith("HF"):  # a base variant is timed against the base
            continue
        base = table.get((r.model, "none", r.case.split(" x")[0], r.path))
        if base is not None:
            p = r.prof
            per = f", {p.lora_us / p.lora_launches:.1f} µs per launch" if p.lora_launches else ""
            busy = f"{p.busy_ms / base.prof.busy_ms:.2f}" if base.prof.busy_ms > 0 else "—"
            kernels = ("" if is_base(r.lora) else f"; LoRA kernels {p.lora_us:.0f} µs in {p.lora_launches:.0f} launches{per}"
                       + "".join(f"; `{name}` {us:.0f} µs ×{calls:.0f}" for name, us, calls in p.lora_by_kernel))
            vs_base.append(f"- {r.model} {r.case} {r.path}{'' if r.lora == 'lora' else f' ({r.lora})'}: "
                           f"{'variant' if is_base(r.lora) else 'LoRA'} / base = {r.wall_ms:.3f} / {base.wall_ms:.3f} = "
                           f"**{r.wall_ms / base.wall_ms:.2f}** (GPU busy {busy}){kernels}")
    if vs_base:
        out += ["", "LoRA against the base model, same case and path (wall):", *vs_base]
    vs_breakable = []
    for r in rows:
        breakable = table.get((r.model, r.lora, r.case, "breakable"))
        if r.path.startswith("tc_piecewise") and breakable is not None:
            vs_breakable.append(f"- {r.model} {r.case}: {r.path} / breakable = {r.wall_ms:.3f} / "
                                f"{breakable.wall_ms:.3f} = **{r.wall_ms / breakable.wall_ms:.2f}**")
    if vs_breakable:
        out += ["", "tc_piecewise against the breakable graph (wall):", *vs_breakable]
    if notes:
        out += ["", *[f"- {n}" for n in notes]]
    out += ["", "Top kernels (µs per forward, calls per forward):", ""]
    for r in rows:
        tops = "; ".join(f"`{name[:70]}` {us:.0f} µs ×{calls:.0f}" for name, us, calls in r.prof.top)
        out.append(f"- {r.model} {r.lora} {r.case} {r.path}: {tops or '(no device kernels)'}")
    out += ["", "GPU idle before a kernel or copy, by its name (µs per forward, gaps per forward; the "
            "largest once-per-forward entry is the host work before the first launch):", ""]
    for r in rows:
        idle = "; ".join(f"`{name[:60]}` {us:.0f} µs ×{calls:.1f}" for name, us, calls in r.prof.idle_before)
        out.append(f"- {r.model} {r.lora} {r.case} {r.path}: {idle or '(none)'}")
    out += ["", "Host time per forward by phase of ModelRunner.forward (µs, without the profiler; "
            "benchmark/host_phases.py):", ""]
    for r in rows:
        if r.prof.host:
            out.append(f"- {r.model} {r.lora} {r.case} {r.path}: {host_phases.summary(r.prof.host)}")
    return "\n".join(out) + "\n"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _batches(s: str) -> list[list[int]]:
    out = []
    for item in s.split(","):
        if item.strip():
            n, tokens = item.lower().split("x")
            out.append([int(tokens)] * int(n))
    return out


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--tokens", type=_ints, default=[128, 2048, 4096], help="prefill token counts (batch 1)")
    p.add_argument("--decode-bs", type=_ints, default=[1])
    p.add_argument("--lora", default="none,lora",
                   help=f"which of {','.join(LORA_VARIANTS)} to run (LORA_VARIANTS: their --lora-fuse-norm "
                        "and SGLANG_LORA_ROWWISE_DECODE)")
    p.add_argument("--lora-backend", default="csgmv")
    p.add_argument("--lora-fold", default="auto", choices=["auto", "on", "off"],
                   help="off: every module unfolded (base GEMM + shrink + expand), as many slots make qkv / gate_up")
    p.add_argument("--adapters", type=int, default=1, help="rank-16 adapters loaded (= pool slots)")
    p.add_argument("--decode-adapters", type=_ints, default=[1], help="distinct adapters per decode batch")
    p.add_argument("--prefill-batches", type=_batches, default=[], help="e.g. 4x512,8x256 (requests x tokens)")
    p.add_argument("--paths", default="all", choices=["all", "graph"], help="graph: breakable and decode graph only")
    p.add_argument("--tc-modes", type=lambda v: [m for m in v.split(",") if m], default=["default"],
                   help="tc_piecewise prefill graphs to measure on the base model: compile modes, e.g. "
                        "default,max-autotune ('' for none)")
    p.add_argument("--hf-anchor", dest="hf_anchor", action="store_true", default=None)
    p.add_argument("--no-hf-anchor", dest="hf_anchor", action="store_false")
    p.add_argument("--hf-tokens", type=_ints, default=[128, 2048])
    p.add_argument("--hf-compile-mode", default="reduce-overhead")
    p.add_argument("--hf-compile-backend", default="inductor", help="'eager' for a quick dry run")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="KV pool of each runner (default 65536); smaller lets more variants share an 80 GiB card")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--rounds", type=int, default=1,
                   help="measure the walls of the LoRA variants in turn this many times (all runners alive)")
    p.add_argument("--profile-repeats", type=int, default=3)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "sglang-profile-forward"))
    p.add_argument("--out", default=None, help="also write the markdown here")
    p.add_argument("--anchor-only", metavar="JSON", default=None,
                   help="measure the HF anchor alone and write its rows here (the child process main runs)")
    args = p.parse_args(argv)
    args.lora = [x.strip() for x in args.lora.split(",") if x.strip()]
    if any(x not in LORA_VARIANTS for x in args.lora):
        p.error(f"--lora takes {', '.join(LORA_VARIANTS)}")
    if args.hf_anchor is None:
        try:
            import peft  # noqa: F401
            import transformers  # noqa: F401

            args.hf_anchor = True
        except ImportError:
            args.hf_anchor = False
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device (use --device cpu for a dry run)")
    return args


def main(argv: Optional[list[str]] = None) -> str:
    args = parse_args(argv)
    t0 = time.perf_counter()
    ckpt, adapters = write_assets(args.root, args.model, num_adapters=args.adapters)
    if args.anchor_only:
        hf_rows, notes = hf_anchor_profiles(args, hf_anchor_walls(args, args.model, ckpt))
        with open(args.anchor_only, "w") as f:
            json.dump({"rows": [dataclasses.asdict(r) for r in hf_rows], "notes": notes}, f)
        return ""
    # The anchor first, in a process of its own (its GPU memory is free again before the engine's
    # runners are built); then every wall of the engine's, then every profile: a profiler session
    # slows the rest of its process down (measure_setup).
    hf_rows: list[Row] = []
    notes: list[str] = []
    if args.hf_anchor:
        log(f"{args.model}: the HF anchor in a process of its own")
        hf_rows, notes = hf_anchor_in_own_process(list(argv if argv is not None else sys.argv[1:]))
    setups, walls = engine_walls(args, args.model, ckpt, adapters)
    rows = engine_profiles(args, args.model, setups, walls) + hf_rows
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU (dry run)"
    md = (f"### {args.model}, {device}, torch {torch.__version__}, {args.adapters} adapter slot(s) "
          f"({time.strftime('%Y-%m-%d')}, {time.perf_counter() - t0:.0f} s)\n\n" + to_markdown(rows, notes, tuple(args.tc_modes)))
    print(md)
    if args.out:
        with open(args.out, "w") as f:
            f.write(md)
    return md


if __name__ == "__main__":
    main()
