"""The tensor-parallel group of one rank, and its collectives.

A `TensorParallelGroup` is the TP group as one rank sees it: its rank and size, the process group
that carries tensors (NCCL on CUDA, gloo on CPU) and a gloo group that carries Python objects (the
scheduler's incoming messages; NCCL would stage them through the GPU). The collectives are its
methods, and at size 1 each is an identity, so a single-GPU run pays nothing for them.

A layer gets its group from its constructor (`tp_group=`, SINGLE_RANK by default): the model
class hands the loader's group to every layer it builds. There is no module-level group to look up.

CUDA graphs: `all_reduce` is an in-place `torch.distributed.all_reduce` on the NCCL group, which
NCCL >= 2.9 lets a CUDA graph capture. What torch needs for that: the communicator must exist
before the capture starts (`init_tensor_parallel` passes `device_id`, which creates it eagerly, and
runs one warm-up all-reduce); no `async_op`; every rank captures and replays the same sequence of
collectives (a collective property: every rank must take the same graph-or-eager decision); and
the capture should use `capture_error_mode="thread_local"` so that ProcessGroupNCCL's watchdog
thread, which queries CUDA events, cannot invalidate a capture in progress.
"""

from __future__ import annotations

import datetime
import logging
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from sglang.srt.distributed.rank_layout import RankSpec

logger = logging.getLogger(__name__)


class TensorParallelGroup:
    """The TP group as seen by one rank. Ranks are numbered 0..size-1; rank 0 talks to the
    tokenizer manager."""

    def __init__(
        self,
        rank: int = 0,
        size: int = 1,
        device_group: Optional["ProcessGroup"] = None,
        cpu_group: Optional["ProcessGroup"] = None,
    ) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"tp rank {rank} is not in 0..{size - 1}")
        self.rank = rank
        self.size = size
        self.device_group = device_group
        self.cpu_group = cpu_group if cpu_group is not None else device_group

    @classmethod
    def layout_only(cls, rank: int, size: int) -> "TensorParallelGroup":
        """A rank's place in a group that was never connected: enough to build and load a shard
        (tests, tools), not to run a forward at size > 1."""
        return cls(rank, size)

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    def __repr__(self) -> str:
        state = "connected" if self.device_group is not None else "single" if self.size == 1 else "layout only"
        return f"TensorParallelGroup(rank={self.rank}, size={self.size}, {state})"

    def _group(self, group: Optional["ProcessGroup"]) -> "ProcessGroup":
        if group is None:
            raise RuntimeError(f"{self!r} has no process group: it cannot run collectives")
        return group

    # ------------------------------------------------------------------ tensors (device group)
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns `x`. Capturable in a CUDA graph (module doc)."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        assert x.is_contiguous(), "all_reduce works in place on a contiguous tensor"
        dist.all_reduce(x, group=self._group(self.device_group))
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim` in rank order: [..., n, ...] -> [..., size*n, ...].
        The result is the same on every rank."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        dim = dim % x.dim()
        stacked = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
        # torch >= 2.13 names it all_gather_single; older releases all_gather_into_tensor.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(stacked.view(self.size * x.shape[0], *x.shape[1:]), x, group=self._group(self.device_group))
        return stacked.movedim(0, dim).flatten(dim, dim + 1)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite `x` on every rank with rank `src`'s `x`, in place; returns `x`."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        dist.broadcast(x, src=src, group=self._group(self.device_group))
        return x

    # ------------------------------------------------------------------ Python objects (cpu group)
    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank `src`'s picklable `obj` on every rank (what the other ranks pass is ignored)."""
        if self.size == 1:
            return obj
        import torch.distributed as dist

        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src, group=self._group(self.cpu_group))
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable `obj`, in rank order."""
        if self.size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self._group(self.cpu_group))
        return out

    def min_over_ranks(self, value: int) -> int:
        """The smallest `value` of all ranks (e.g. the KV capacity every rank can hold)."""
        if self.size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._group(self.cpu_group))
        return int(t[0])

    def barrier(self) -> None:
        if self.size > 1:
            import torch.distributed as dist

            dist.barrier(group=self._group(self.cpu_group))


SINGLE_RANK = TensorParallelGroup(0, 1)

def init_tensor_parallel(spec: "RankSpec") -> TensorParallelGroup:
    """Join this process to its TP group (blocks until every rank has joined, or the timeout)."""
    if spec.tp_size == 1:
        return SINGLE_RANK
    import torch.distributed as dist

    timeout: dict[str, Any] = {}
    if spec.timeout_s is not None:
        timeout["timeout"] = datetime.timedelta(seconds=spec.timeout_s)
    kwargs = dict(timeout)
    if spec.backend == "nccl":
        torch.cuda.set_device(spec.local_rank)
        # Creates the NCCL communicator now rather than at the first collective, which could
        # otherwise fall inside a CUDA-graph capture.
        kwargs["device_id"] = torch.device("cuda", spec.local_rank)
    dist.init_process_group(
        spec.backend, init_method=spec.init_method, rank=spec.tp_rank, world_size=spec.tp_size, **kwargs
    )
    device_group = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo", **timeout) if spec.backend != "gloo" else device_group
    group = TensorParallelGroup(spec.tp_rank, spec.tp_size, device_group, cpu_group)
    device = torch.device("cuda", spec.local_rank) if spec.backend == "nccl" else torch.device("cpu")
    group.all_reduce(torch.zeros(1, device=device))  # warm-up: every link is up before we go on
    logger.info("Joined the tensor-parallel group: rank %d of %d (%s)", spec.tp_rank, spec.tp_size, spec.backend)
    return group


def destroy_tensor_parallel(group: TensorParallelGroup) -> None:
    if group.size > 1 and group.device_group is not None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
