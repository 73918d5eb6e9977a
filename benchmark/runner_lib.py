"""Shared helpers of the in-process benchmarks (`lora/bench_prefill_graph.py`, `profile_forward.py`):
config-only checkpoints and PEFT adapters at real shapes, a ModelRunner on dummy weights, batches
built through the engine's own batch builder, and timing that checks which path served each pass.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional, Sequence, Union

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from sglang.srt.distributed import SINGLE_RANK, TensorParallelGroup  # noqa: E402
from sglang.srt.lora.lora_config import PEFT_PROJECTIONS  # noqa: E402
from sglang.srt.model_executor.batch_builder import (  # noqa: E402
    DecodeRequest,
    ExtendRequest,
    build_decode_batch,
    build_extend_batch,
)
from sglang.srt.configs.forward_path import ForwardPath  # noqa: E402
from sglang.srt.model_executor.model_runner import ModelRunner  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from sglang.srt.server_configs import build_run_configs  # noqa: E402
from sglang.srt.tools.demo import DemoAdapterSpec, write_peft_adapter  # noqa: E402
from sglang.srt.tools.make_checkpoint import make_checkpoint  # noqa: E402

# make_checkpoint preset -> architecture.
SHAPES = {"qwen3-4b": "qwen3", "llama-3.1-8b": "llama", "llama-3.1-70b": "llama", "qwen2.5-0.5b": "qwen2",
          "tiny": "qwen3"}
DECODE_CONTEXT = 256  # tokens of (garbage) KV each decode request attends to


def sync(device: Optional[torch.device] = None) -> None:
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize()


def write_assets(root: str, shape: str, num_adapters: int, rank: int = 16) -> tuple[str, dict[str, str]]:
    """A config-only checkpoint of `shape` (weights come from --load-format dummy; the `tiny`
    preset has real weights) and `num_adapters` random PEFT adapters of `rank` on all seven
    projections. Reused when already on disk."""
    ckpt = os.path.join(root, shape)
    if not os.path.exists(os.path.join(ckpt, "config.json")):
        make_checkpoint(ckpt, arch=SHAPES[shape], preset=shape, with_weights=shape == "tiny")
    with open(os.path.join(ckpt, "config.json")) as f:
        config = json.load(f)
    adapters = {}
    for i in range(num_adapters):
        out = os.path.join(root, f"{shape}-lora{i}-r{rank}")
        if not os.path.exists(os.path.join(out, "adapter_config.json")):
            os.makedirs(out, exist_ok=True)
            write_peft_adapter(out, config, DemoAdapterSpec(f"lora{i}", rank, 2 * rank, PEFT_PROJECTIONS, 100 + i))
        adapters[f"lora{i}"] = out
    return ckpt, adapters


def build_runner(
    ckpt: str,
    lora_backend: Optional[str],
    adapters: dict[str, str],
    prefill_buckets: list[int],
    decode_buckets: list[int],
    tp_group: Optional[TensorParallelGroup] = None,
    **overrides: Any,
) -> ModelRunner:
    """A bf16 ModelRunner on dummy weights, triton attention, breakable prefill graphs and full
    decode graphs at exactly the given buckets; LoRA (rank 16) when `lora_backend` is set; this
    rank's shard when given a tensor-parallel group."""
    kwargs: dict[str, Any] = dict(
        model_path=ckpt, load_format="dummy", dtype="bfloat16", attention_backend="triton",
        max_total_tokens=65536, max_running_requests=64, chunked_prefill_size=8192,
        cuda_graph_backend_prefill="breakable", cuda_graph_backend_decode="full",
        cuda_graph_bs_prefill=sorted(set(prefill_buckets)), cuda_graph_bs_decode=sorted(set(decode_buckets)),
    )
    if lora_backend is not None:
        kwargs.update(lora_paths=[f"{n}={p}" for n, p in adapters.items()], lora_backend=lora_backend,
                      max_loras_per_batch=len(adapters), max_lora_rank=16)
    kwargs.update(overrides)
    group = tp_group or SINGLE_RANK
    kwargs["tp_size"] = group.size
    gpu_id = torch.cuda.current_device() if group.size > 1 and torch.cuda.is_available() else 0
    return ModelRunner(build_run_configs(ServerArgs(**kwargs)).scheduler.runner, gpu_id=gpu_id, tp_group=group)


def use_prefill_graphs(runner: ModelRunner, sets: tuple) -> None:
    """Point the runner at (graph set for batches with LoRA work, set for all-base batches)."""
    runner.prefill_graph_runner, runner.base_prefill_graph_runner = sets


def use_decode_graphs(runner: ModelRunner, sets: tuple) -> None:
    runner.decode_graph_runner, runner.base_decode_graph_runner = sets


def runner_takes_graph(runner: ModelRunner, fb) -> bool:
    """The runner's own decision for this batch (the counters it bumps do not matter here)."""
    return runner.choose_forward_path(fb).path.is_graph


def lora_id(runner: ModelRunner, name: Optional[str]) -> Optional[str]:
    if name is None or runner.lora_manager is None:
        return None
    return next(i for i, ref in runner.lora_manager.refs.items() if ref.lora_name == name)


def forward_checked(runner: ModelRunner, fb, expect_graph: bool):
    out = runner.forward(fb)
    if out.used_cuda_graph != expect_graph:
        raise RuntimeError(f"used_cuda_graph={out.used_cuda_graph}, expected {expect_graph}")
    return out


def time_ms(fn: Callable[[], Any], warmup: int, repeats: int, device: Optional[torch.device] = None) -> float:
    """Median wall time of `fn()` in ms, the device synchronised around each call."""
    times = []
    for i in range(warmup + repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_forward(runner: ModelRunner, fb, expect_graph: bool, warmup: int, repeats: int) -> float:
    return time_ms(lambda: forward_checked(runner, fb, expect_graph), warmup, repeats, runner.device)


def prefill_batch(runner: ModelRunner, lengths: list[int], names: list[Optional[str]]):
    """One EXTEND batch of fresh requests of `lengths` tokens (random ids), adapters by name."""
    rows = runner.req_to_token_pool.alloc(len(lengths))
    gen = torch.Generator().manual_seed(0)
    reqs = []
    for row, n, name in zip(rows, lengths, names):
        slots = runner.token_to_kv_pool_allocator.alloc(n)
        ids = torch.randint(10, min(1000, runner.model_config.vocab_size), (n,), generator=gen).tolist()
        reqs.append(ExtendRequest(row, ids, 0, slots, lora_id=lora_id(runner, name)))
    fb = build_extend_batch(reqs, runner.req_to_token_pool, runner.device,
                            enable_lora=runner.lora_manager is not None)
    return fb, rows, [r.out_cache_loc for r in reqs]


def decode_batch(runner: ModelRunner, bs: int, name: Union[Optional[str], Sequence[Optional[str]]],
                 context: int = DECODE_CONTEXT):
    """One DECODE batch of `bs` requests with `context` tokens each (their KV is whatever is there);
    `name` is one adapter for all, or a list the requests take in turn."""
    names = list(name) if isinstance(name, (list, tuple)) else [name]
    rows = runner.req_to_token_pool.alloc(bs)
    slots = runner.token_to_kv_pool_allocator.alloc(bs * context)
    for i, row in enumerate(rows):
        runner.req_to_token_pool.write(row, 0, slots[i * context:(i + 1) * context])
    reqs = [DecodeRequest(row, 7, context, int(slots[(i + 1) * context - 1]),
                          lora_id=lora_id(runner, names[i % len(names)])) for i, row in enumerate(rows)]
    fb = build_decode_batch(reqs, runner.req_to_token_pool, runner.device,
                            enable_lora=runner.lora_manager is not None)
    return fb, rows, [slots]


def release(runner: ModelRunner, rows, slot_lists) -> None:
    for s in slot_lists:
        runner.token_to_kv_pool_allocator.free(torch.as_tensor(s))
    runner.req_to_token_pool.free(rows)
