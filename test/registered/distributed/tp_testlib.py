"""Run a function on N real ranks (spawned processes joined by torch.distributed) and collect what
each rank returns.

    results = run_on_ranks(check_layers, world_size=2)   # [rank 0's result, rank 1's result]

`fn(group, *args)` runs in every rank with that rank's `TensorParallelGroup` (gloo on CPU, NCCL
with backend="nccl"); it must be a module-level function of an importable module. A rank that
raises fails the call with its traceback; a hang fails it after `timeout` seconds, and every rank
process is gone when the call returns.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if os.path.join(ROOT, "python") not in sys.path:
    sys.path.insert(0, os.path.join(ROOT, "python"))

from sglang.srt.utils import get_free_port  # noqa: E402  (no test-server helpers: the GPU host lacks requests)


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, backend: str, port: int, args: tuple,
               results: Any) -> None:
    import torch

    from sglang.srt.distributed import RankSpec, destroy_tensor_parallel, init_tensor_parallel

    torch.set_num_threads(1)
    try:
        spec = RankSpec(tp_rank=rank, tp_size=world_size, local_rank=rank, backend=backend,
                        init_method=f"tcp://127.0.0.1:{port}", timeout_s=120)
        group = init_tensor_parallel(spec)
        out = fn(group, *args)
        group.barrier()
        destroy_tensor_parallel(group)
        results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", traceback.format_exc()))


def run_on_ranks(fn: Callable[..., Any], *args: Any, world_size: int = 2, backend: str = "gloo",
                 timeout: float = 300.0) -> list[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = get_free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, backend, port, args, results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    outs: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(outs) < world_size and not errors:
            try:
                rank, status, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in outs and p.exitcode not in (None, 0)]
                if dead:  # died without a report (killed, or failed before reaching its function)
                    errors.append(f"rank(s) {dead} exited with code(s) {[procs[r].exitcode for r in dead]}")
                elif time.monotonic() > deadline:
                    errors.append(f"ranks {sorted(set(range(world_size)) - set(outs))} did not finish "
                                  f"within {timeout:.0f} s")
                continue
            if status == "ok":
                outs[rank] = value
            else:  # the other ranks may be stuck in a collective with it: stop here
                errors.append(f"rank {rank} failed:\n{value}")
    finally:
        for p in procs:
            p.join(5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join(5)
    if errors:
        raise AssertionError("\n".join(errors))
    return [outs[r] for r in range(world_size)]
