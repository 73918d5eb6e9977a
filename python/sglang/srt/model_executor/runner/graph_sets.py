"""Which graph runners a ModelRunner holds, planned before anything is captured, and (under tensor
parallelism) the check that every rank planned the same graphs.

A LoRA server holds two graph sets (with the LoRA kernels, and without them for all-base batches),
other servers one; each set has a prefill and a decode runner when that phase has a graph backend.
The runners are first built without capturing (`capture=False`), then captured in a fixed order.

Tensor parallelism: the captured body contains all-reduces, so every rank must capture the same
buckets in the same order, and for every batch every rank must take the same graph-or-eager
decision (`ModelRunner.choose_forward_path`). That decision reads only the runners' plans
(`graph_plan()`: backends, buckets, batch and request caps, the LoRA metadata's caps) and the batch
itself, which is the same on every rank (DESIGN §11). The plans are built from configuration and
from the KV capacity every rank shares (the smallest of all ranks, `min_over_ranks`), never from
a rank's own free memory, and `agree_on_graph_plans` proves it before the first capture: a rank
whose plan differs stops the start-up with an error naming it, instead of a hang in a capture.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from sglang.srt.configs.cuda_graph_config import Backend
from sglang.srt.distributed import TensorParallelGroup
from sglang.srt.model_executor.runner.cuda_graph_runner import CudaGraphRunner
from sglang.srt.model_executor.runner.graph_runner import GraphHost
from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import PrefillCudaGraphRunner

GraphRunner = Union[CudaGraphRunner, PrefillCudaGraphRunner]


class GraphSetHost(GraphHost):
    """A GraphHost that holds both sets: `prefill_graph_runner`/`decode_graph_runner` with LoRA
    kernels on a LoRA server (the only set otherwise), `base_*` without them for all-base batches."""

    prefill_graph_runner: Optional[PrefillCudaGraphRunner]
    decode_graph_runner: Optional[CudaGraphRunner]
    base_prefill_graph_runner: Optional[PrefillCudaGraphRunner]
    base_decode_graph_runner: Optional[CudaGraphRunner]


def plan_graph_sets(mr: GraphSetHost, prefill: Backend, decode: Backend, lora_kernels: bool) -> list[GraphRunner]:
    """Build the runners (nothing captured yet) onto `mr`; returns them in capture order."""
    lora = mr.lora_manager
    if prefill != Backend.DISABLED:
        if lora is None or lora_kernels:
            mr.prefill_graph_runner = PrefillCudaGraphRunner(mr, prefill, capture_lora=lora_kernels, capture=False)
        if lora is not None:
            mr.base_prefill_graph_runner = PrefillCudaGraphRunner(mr, prefill, capture_lora=False, capture=False)
    if decode != Backend.DISABLED:
        if lora is None or lora_kernels:
            mr.decode_graph_runner = CudaGraphRunner(mr, decode, capture_lora=lora_kernels, capture=False)
        if lora is not None:
            mr.base_decode_graph_runner = CudaGraphRunner(mr, decode, capture_lora=False, capture=False)
    runners = (mr.prefill_graph_runner, mr.base_prefill_graph_runner, mr.decode_graph_runner,
               mr.base_decode_graph_runner)
    return [r for r in runners if r is not None]


def graph_plan_problems(plans: list[list[dict[str, Any]]]) -> list[str]:
    """One line per rank whose plans differ from rank 0's (naming the differing fields)."""
    problems = []
    for rank, mine in enumerate(plans[1:], start=1):
        if len(mine) != len(plans[0]):
            problems.append(f"TP rank {rank} plans {len(mine)} graph runner(s), rank 0 plans {len(plans[0])}")
            continue
        for ref, plan in zip(plans[0], mine):
            diff = [f"{k} (rank 0: {ref.get(k)!r}, rank {rank}: {plan.get(k)!r})"
                    for k in sorted(set(ref) | set(plan)) if ref.get(k) != plan.get(k)]
            if diff:
                problems.append(f"TP rank {rank}'s {ref.get('kind')} graphs differ: {', '.join(diff)}")
    return problems


def agree_on_graph_plans(tp_group: TensorParallelGroup, runners: list[GraphRunner]) -> list[dict[str, Any]]:
    """Every rank's plans; RuntimeError if any rank's differ (call on every rank, before capture)."""
    mine = [r.graph_plan() for r in runners]
    if tp_group.size == 1:
        return mine
    problems = graph_plan_problems(tp_group.all_gather_object(mine))
    if problems:
        raise RuntimeError(
            "The tensor-parallel ranks planned different CUDA graphs, so their collectives would not "
            "pair up: " + "; ".join(problems)
        )
    return mine
