"""What each rank runs in test_tp_gpu.py: the real model with LoRA over NCCL on two GPUs, bf16.

  - bf16 tracking: a mixed batch's prompt logprobs at tp 2 against the float32 tp-1 reference may
    be off by at most twice what tp 1's own bf16 run is off, plus 0.05 nats (mean: plus 0.02), the
    bf16 rule of the PEFT parity test; the adapter must still move the logprobs at this precision.
  - graphs: for (LoRA backend, prefill graph, decode graph, --lora-fold) in GRAPH_CONFIGS a tp-2 runner with
    CUDA graphs (the all-reduces captured inside them) against a tp-2 eager runner: prompt
    logprobs within 1e-2 with every prefill replayed, and a mixed-adapter batch's greedy tokens
    equal over DECODE_STEPS steps, every step replayed.
Every rank returns what it saw; the test also checks that both ranks saw the same tokens.
`device="cpu"` is the dry run (gloo, float32, torch_native attention, no graphs: the "graph"
runners run eagerly), for the plumbing only.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Optional

import torch

from sglang.srt.distributed import SINGLE_RANK, TensorParallelGroup
from tp_model_checks import make_runner

# csgmv folded into the base GEMMs (the default at these sizes), triton with separate kernels.
GRAPH_CONFIGS = [("csgmv", "breakable", "breakable", "auto"), ("triton", "full", "full", "off")]
PREFILL_BUCKETS = [16, 64, 256]
DECODE_BUCKETS = [1, 2, 4, 8]
DECODE_STEPS = 12


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=gen).tolist() for n in lengths]


_P = _prompts([29, 37, 130], seed=1)
PROMPTS = [_P[0], _P[0], _P[1], _P[2]]  # 233 tokens: the 256-token bucket
NAMES = [None, "a", "b", "a"]  # the first prompt with and without an adapter


def _runner(ckpt: str, paths: dict[str, str], group: TensorParallelGroup, backend: str, dtype: str,
            graphs: Optional[tuple[str, str]] = None, device: str = "cuda", fold: str = "auto"):
    extra: dict[str, Any] = dict(disable_cuda_graph=True, lora_fold=fold)
    if device != "cuda":  # the dry run
        dtype = "float32"
    elif graphs is not None:
        extra = dict(disable_cuda_graph=False, lora_fold=fold, cuda_graph_backend_prefill=graphs[0],
                     cuda_graph_backend_decode=graphs[1], cuda_graph_bs_prefill=PREFILL_BUCKETS,
                     cuda_graph_bs_decode=DECODE_BUCKETS)
    return make_runner(ckpt, backend, paths, group, device=device, dtype=dtype,
                       attention_backend="triton" if device == "cuda" else "torch_native",
                       max_total_tokens=16384, max_running_requests=64,
                       max_lora_rank=16, **extra)


def _ids(mr) -> list[Optional[str]]:
    by_name = {ref.lora_name: lid for lid, ref in mr.lora_manager.refs.items()}
    return [by_name.get(n) for n in NAMES]


def prompt_logprobs(mr) -> tuple[list[list[float]], bool]:
    from helpers import EngineDriver

    driver = EngineDriver(mr)
    seqs = [driver.add(p, lora_id=lid) for p, lid in zip(PROMPTS, _ids(mr))]
    try:
        out = driver.extend(seqs, logprob_start=0)
        return out.input_token_logprobs, out.used_cuda_graph
    finally:
        for seq in seqs:
            driver.release(seq)


def greedy(mr) -> tuple[list[list[int]], list[bool]]:
    from helpers import EngineDriver

    return EngineDriver(mr).greedy(PROMPTS, DECODE_STEPS, _ids(mr))


def _progress(group: TensorParallelGroup, start: float, stage: str) -> None:
    # Streamed to stderr (run pytest with -s): the first H200 run of these checks was cut off by
    # its time limit after 218 s with nothing to show where it was.
    print(f"[tp_gpu_checks rank {group.rank}] {time.monotonic() - start:6.1f} s: {stage}", file=sys.stderr, flush=True)


@torch.no_grad()
def gpu_checks(group: TensorParallelGroup, ckpt: str, paths: dict[str, str], device: str = "cuda") -> dict[str, Any]:
    out: dict[str, Any] = {}
    start = time.monotonic()
    # Both ranks compute the tp-1 runs (side by side on their own GPUs: no collectives).
    out["ref32"], _ = prompt_logprobs(_runner(ckpt, paths, SINGLE_RANK, "torch_native", "float32", device=device))
    _progress(group, start, "tp 1 float32 reference")
    out["tp1_bf16"], _ = prompt_logprobs(_runner(ckpt, paths, SINGLE_RANK, "csgmv", "bfloat16", device=device))
    _progress(group, start, "tp 1 bf16")
    out["tp2_bf16"], _ = prompt_logprobs(_runner(ckpt, paths, group, "csgmv", "bfloat16", device=device))
    _progress(group, start, "tp 2 bf16")
    _free(device)
    for backend, prefill, decode, fold in GRAPH_CONFIGS:
        key = f"{backend}/{prefill}/{decode}/fold-{fold}"
        eager = _runner(ckpt, paths, group, backend, "bfloat16", device=device, fold=fold)
        graph = _runner(ckpt, paths, group, backend, "bfloat16", graphs=(prefill, decode), device=device, fold=fold)
        _progress(group, start, f"{key}: eager and graph runners built (graphs captured)")
        out[key] = {
            "eager_prompt": prompt_logprobs(eager)[0], "graph_prompt": prompt_logprobs(graph),
            "eager_greedy": greedy(eager)[0], "graph_greedy": greedy(graph),
            "graph_stats": graph.graph_stats(), "folded": list(graph.lora_manager.pool.fold_modules),
        }
        del eager, graph
        _free(device)
        _progress(group, start, f"{key}: compared")
    return out


def _free(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()
