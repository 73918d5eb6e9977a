"""What each rank runs in test_tp_nccl_gpu.py: the sharded layers' collectives inside CUDA graphs.

A small TP body (vocab-parallel embedding -> QKV -> o_proj all-reduce -> gate_up -> down
all-reduce, twice) is captured the two ways the engine captures a body: whole, with
`capture_graph(breakable=False)` (the decode and full prefill graphs, thread_local capture mode),
and as a `BreakableCUDAGraph` with an eager break in the middle (the breakable
prefill graph, thread_local capture mode). Each replay with fresh inputs must equal the eager body
bit for bit, on every rank. `capture=False` runs only the eager parts (the CPU dry run).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.distributed import SINGLE_RANK, TensorParallelGroup
from sglang.srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from sglang.srt.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from sglang.srt.model_executor.model_loading import init_dummy_weights

HIDDEN, HEAD, HEADS, KV_HEADS, INTER, VOCAB, TOKENS = 256, 64, 8, 2, 512, 1001, 24


class Body(nn.Module):
    def __init__(self, layers: int = 2, group: TensorParallelGroup = SINGLE_RANK) -> None:
        super().__init__()
        g = group
        self.embed_tokens = VocabParallelEmbedding(VOCAB, HIDDEN, tp_group=g)
        self.qkv = nn.ModuleList(QKVParallelLinear(HIDDEN, HEAD, HEADS, KV_HEADS, tp_group=g) for _ in range(layers))
        self.o = nn.ModuleList(RowParallelLinear(HEADS * HEAD, HIDDEN, tp_group=g) for _ in range(layers))
        self.gate_up = nn.ModuleList(MergedColumnParallelLinear(HIDDEN, [INTER, INTER], tp_group=g)
                                     for _ in range(layers))
        self.down = nn.ModuleList(RowParallelLinear(INTER, HIDDEN, tp_group=g) for _ in range(layers))
        self.lm_head = ParallelLMHead(VOCAB, HIDDEN, tp_group=g)

    def forward(self, ids: torch.Tensor, breaker: Any = None) -> torch.Tensor:
        h = self.embed_tokens(ids)
        for i, (qkv, o, gate_up, down) in enumerate(zip(self.qkv, self.o, self.gate_up, self.down)):
            q = qkv(h)[:, : qkv.q_proj_shard_size]
            if breaker is not None and i == 0:  # an eager call between two segments, like attention
                q = breaker.eager(lambda ctx, t: torch.tanh(t), q)
            h = h + o(q)
            n = gate_up.output_sizes[0]
            a = gate_up(h)
            h = h + down(F.silu(a[:, :n]) * a[:, n:])
        return h


def _inputs(trial: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + trial)  # the same ids on every rank
    return torch.randint(0, VOCAB, (TOKENS,), generator=g).to(device)


@torch.no_grad()
def graphs_vs_eager(group: TensorParallelGroup, capture: bool = True) -> dict[str, Any]:
    from sglang.srt.model_executor.runner.breakable_cuda_graph import BreakableCUDAGraph
    from sglang.srt.model_executor.runner.graph_capture import capture_graph

    device = torch.device("cuda", torch.cuda.current_device()) if capture else torch.device("cpu")
    dtype = torch.bfloat16 if capture else torch.float32
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            body = Body(group=group)
        with torch.device(device):
            full = Body()  # size-1 reference with the same dummy weights
    finally:
        torch.set_default_dtype(old)
    init_dummy_weights(body, seed=5, std=0.05)
    init_dummy_weights(full, seed=5, std=0.05)
    out: dict[str, Any] = {"tp_vs_tp1": [], "whole": [], "breakable": []}
    ids = torch.zeros(TOKENS, dtype=torch.int64, device=device)
    for trial in range(3):
        ids.copy_(_inputs(trial, device))
        out["tp_vs_tp1"].append(float((body(ids) - full(ids)).abs().max()))
        out.setdefault("logits_shape", list(body.lm_head.compute_logits(body(ids)).shape))
    if not capture:
        return out

    pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(device)
    static: dict[str, torch.Tensor] = {}

    def run_whole() -> None:
        static["whole"] = body(ids)

    whole = capture_graph(False, run_whole, SimpleNamespace(), pool, stream)
    breakable = BreakableCUDAGraph(pool=pool)
    with torch.cuda.stream(stream):
        body(ids, breaker=breakable)  # warm-up through the seam (not capturing: runs eagerly)
    torch.cuda.synchronize()
    holder = {"out": breakable.capture(lambda: body(ids, breaker=breakable), ctx=None, stream=stream)}
    torch.cuda.synchronize()
    for trial in range(3, 6):
        ids.copy_(_inputs(trial, device))
        eager_whole = body(ids)
        eager_break = body(ids, breaker=SimpleNamespace(eager=lambda fn, *t: fn(None, *t)))
        whole.replay()
        breakable.replay(None)
        torch.cuda.synchronize()
        out["whole"].append(bool(torch.equal(static["whole"], eager_whole)))
        out["breakable"].append(bool(torch.equal(holder["out"], eager_break)))
    out["segments"] = breakable.num_segments
    out["digest"] = float(static["whole"].float().sum())  # the same on every rank
    return out
