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

Memory. A graph per token bucket, two graph sets on a LoRA server: what a graph keeps allocated
must not grow with the bucket sum. So a break keeps neither of its tensors:
  - its inputs (q, k, v: outputs of the preceding segment, in the shared graph pool) are *borrowed*:
    the break holds tensors on their addresses that do not keep them allocated. Once the capture
    is over the pool may give that memory to later captures; they write it only during their own
    replays, and replays never overlap, so at this graph's replay its segment writes the inputs
    and its break reads them before anything else can;
  - its output is copied into `BreakOutputs`, one buffer shared by every break of the graphs that
    use it (a break's output is read by the next segment only, before the next break writes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar

import torch

from sglang.srt.configs.forward_batch_info import GraphBreaker

T = TypeVar("T")


@dataclass
class _Break:
    fn: Callable[..., torch.Tensor]
    # Inputs produced by the preceding segment (borrowed), and the output the next segment reads
    # (a view of BreakOutputs; None when `fn` writes into its last, borrowed, argument); the
    # segments captured both addresses.
    args: tuple[torch.Tensor, ...]
    out: Optional[torch.Tensor]


class _DeviceMemory:
    """Describes a tensor's memory through `__cuda_array_interface__`; a tensor that
    `torch.as_tensor` makes from it views that memory without owning it."""

    def __init__(self, t: torch.Tensor) -> None:
        size = t.element_size()
        self.__cuda_array_interface__ = {
            "shape": tuple(t.shape),
            "strides": tuple(stride * size for stride in t.stride()),
            "typestr": f"<i{size}",  # an integer of the element's width, viewed back as t.dtype
            "data": (t.data_ptr(), False),
            "version": 2,
        }


def borrow(t: torch.Tensor) -> torch.Tensor:
    """A tensor on `t`'s memory that does not keep it allocated (see the module docstring)."""
    return torch.as_tensor(_DeviceMemory(t), device=t.device).view(t.dtype)


class BreakOutputs:
    """One buffer per dtype for the outputs of every break of the graphs that share it. Sized by
    the first (largest) output it is given, so graphs must be captured largest bucket first."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def view(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The buffer's prefix as a tensor of `shape` (allocated by the first, largest, request)."""
        numel = math.prod(shape)
        key = (dtype, torch.device(device))
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        if buf.numel() < numel:
            raise ValueError(
                f"a break output of {numel} elements exceeds the shared buffer ({buf.numel()}): "
                "capture the largest bucket first"
            )
        return buf[:numel].view(shape)

    def owns(self, t: torch.Tensor) -> bool:
        buf = self._buffers.get((t.dtype, t.device))
        return buf is not None and t.data_ptr() == buf.data_ptr()

    def hold(self, out: torch.Tensor) -> torch.Tensor:
        """A view of the buffer holding `out` (what the next segment reads): `out` itself when the
        break already wrote there (see `BreakableCUDAGraph.output_buffer`), else a copy."""
        if self.owns(out):
            return out
        view = self.view(tuple(out.shape), out.dtype, out.device)
        view.copy_(out)
        return view

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


class BreakableCUDAGraph(GraphBreaker):
    def __init__(self, pool: Optional[Any] = None, outputs: Optional[BreakOutputs] = None) -> None:
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.outputs = outputs if outputs is not None else BreakOutputs()
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
        with torch.cuda.stream(stream):
            try:
                self._begin_segment()
                out = body()
                self._end_segment()
            finally:
                self._ctx = None
                # Body raised mid-segment: end the capture before unwinding, on the stream it began
                # on (still current here), or the stream stays capturing and every later CUDA call
                # of the process fails.
                if self._current is not None:
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
        out = self.outputs.hold(fn(self._ctx, *tensors))
        # The shared output buffer is passed as itself (it outlives the graph anyway): the break
        # then returns `brk.out` at replay and nothing is copied. A borrowed alias of it would be
        # another tensor object, and `copy_` onto the same address still costs a host-side copy.
        args = tuple(t if self.outputs.owns(t) else borrow(t) for t in tensors)
        self.breaks.append(_Break(fn=fn, args=args, out=out))
        self._begin_segment()
        return out

    def eager_into(self, fn: Callable[..., None], out: torch.Tensor, *tensors: torch.Tensor) -> None:
        if self._current is None:
            fn(self._ctx, *tensors, out)
            return
        self._end_segment()
        fn(self._ctx, *tensors, out)
        # `out` is borrowed like the inputs: the segment before allocated it and the next one reads it.
        self.breaks.append(_Break(fn=fn, args=tuple(borrow(t) for t in (*tensors, out)), out=None))
        self._begin_segment()

    def output_buffer(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # Under capture: the shared buffer, so the break writes where the next segment reads and a
        # replay copies nothing. A warm-up pass outside capture gets a tensor of its own.
        if self._current is None:
            return torch.empty(shape, dtype=dtype, device=device)
        return self.outputs.view(shape, dtype, device)

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
            if brk.out is not None and result is not brk.out:
                brk.out.copy_(result)
        self.segments[-1].replay()

    @property
    def num_segments(self) -> int:
        return len(self.segments)
