"""The breakable CUDA graph: a chain of captured segments with eager calls between them.

    capture:  begin seg 0 ─ ops ─ end seg 0 │ eager fn_0(capture ctx) │ begin seg 1 ─ ops ─ ... ─ end seg n
    replay:   seg 0.replay() → fn_0(live ctx) → seg 1.replay() → fn_1(live ctx) → ... → seg n.replay()

Every segment is an ordinary `torch.cuda.CUDAGraph`; all of them share one memory pool, so a tensor
produced by segment i (e.g. q/k/v) keeps its address for the eager call i and the output of the eager
call keeps its address for segment i+1. The eager call receives the *live* context at replay (the
live batch with its attention metadata), which is why one graph captured with a single request can
serve any batch whose tokens fit its bucket.

Code inside the captured body asks for a break through the `GraphBreaker` seam that the runner puts
on the ForwardBatch (`forward_batch.graph_breaker.eager(fn, *tensors)`); nothing is monkey-patched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar

import torch

from sglang.srt.model_executor.forward_batch_info import GraphBreaker

T = TypeVar("T")


@dataclass
class _Break:
    fn: Callable[..., torch.Tensor]
    # Inputs produced by the preceding segment, and the output the next segment reads. Both are held
    # for the graph's lifetime: the segments captured their addresses.
    args: tuple[torch.Tensor, ...]
    out: torch.Tensor


class BreakableCUDAGraph(GraphBreaker):
    def __init__(self, pool: Optional[Any] = None) -> None:
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.segments: list[torch.cuda.CUDAGraph] = []
        self.breaks: list[_Break] = []
        self._current: Optional[torch.cuda.CUDAGraph] = None
        self._ctx: Any = None

    # ---------------------------------------------------------------------------- capture
    def capture(self, body: Callable[[], T], ctx: Any, stream: torch.cuda.Stream) -> T:
        """Capture `body()`; breaks inside it call their functions with `ctx` once, eagerly.

        Must run with the capture stream current and the device idle (the caller synchronises).
        """
        assert not self.segments, "a BreakableCUDAGraph is captured once"
        self._ctx = ctx
        try:
            with torch.cuda.stream(stream):
                self._begin_segment()
                out = body()
                self._end_segment()
        finally:
            self._ctx = None
            if self._current is not None:  # body raised mid-segment: close it before unwinding
                try:
                    self._current.capture_end()
                except Exception:
                    pass
                self._current = None
        return out

    def eager(self, fn: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
        if self._current is None:
            # Not capturing (a warm-up pass that reuses the seam): just run it.
            return fn(self._ctx, *tensors)
        self._end_segment()
        out = fn(self._ctx, *tensors)
        self.breaks.append(_Break(fn=fn, args=tensors, out=out))
        self._begin_segment()
        return out

    def _begin_segment(self) -> None:
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads of the process (IPC readers) never touch CUDA, and must not
        # be made to fail if they ever allocate.
        graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
        self._current = graph

    def _end_segment(self) -> None:
        assert self._current is not None
        self._current.capture_end()
        self.segments.append(self._current)
        self._current = None

    # ---------------------------------------------------------------------------- replay
    def replay(self, ctx: Any) -> None:
        """Replay every segment, calling each break with the live context in between."""
        assert len(self.segments) == len(self.breaks) + 1
        for i, brk in enumerate(self.breaks):
            self.segments[i].replay()
            result = brk.fn(ctx, *brk.args)
            if result is not brk.out:
                brk.out.copy_(result)
        self.segments[-1].replay()

    @property
    def num_segments(self) -> int:
        return len(self.segments)
