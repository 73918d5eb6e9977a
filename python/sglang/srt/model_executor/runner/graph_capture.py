"""Capturing one graph of either kind (whole, or breakable at attention), shared by both runners."""

from __future__ import annotations

import gc
from typing import Any, Callable, Optional, Union

import torch

from sglang.srt.configs.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.runner.breakable_cuda_graph import BreakableCUDAGraph, BreakOutputs

AnyGraph = Union[torch.cuda.CUDAGraph, BreakableCUDAGraph]


def capture_graph(
    breakable: bool,
    run: Callable[[], None],
    fb: ForwardBatch,
    pool: Any,
    stream: torch.cuda.Stream,
    break_outputs: Optional[BreakOutputs] = None,
    warmups: int = 2,
) -> AnyGraph:
    """Warm `run` up on the capture stream (Triton compilation and autotuning stay out of the
    graph), then capture it. A breakable capture routes attention through `fb.graph_breaker`, and
    keeps its breaks' outputs in `break_outputs` (shared by the graphs of one runner)."""
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            run()
    stream.synchronize()
    gc.collect()
    if breakable:
        graph: AnyGraph = BreakableCUDAGraph(pool=pool, outputs=break_outputs)
        fb.graph_breaker = graph
        try:
            graph.capture(run, ctx=fb, stream=stream)
        finally:
            fb.graph_breaker = None
    else:
        graph = torch.cuda.CUDAGraph()
        # thread_local, like the breakable graph's segments: a body with tensor-parallel
        # all-reduces records NCCL kernels, and ProcessGroupNCCL's watchdog thread queries CUDA
        # events meanwhile, which the default ("global") mode would turn into a failed capture.
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            run()
    torch.cuda.synchronize()
    return graph
