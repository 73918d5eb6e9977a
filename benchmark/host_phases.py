"""Where a forward's host time goes: perf_counter timers around the phases of `ModelRunner.forward`.

A decode step's wall is host work the GPU waits for (preparing the batch, its metadata copies, the
launches of the eager tail) plus the GPU's own time. torch.profiler inflates the host side several
times over, so this measures it without the profiler: for `n` forwards, synchronised around each
like `runner_lib.time_ms`, each phase's perf_counter time, averaged per forward, in µs.

Phases (nested ones are part of their parent):

  prepare            ModelRunner.prepare: pools attached, path chosen, LoRA prepared
    prepare.lora     LoRAManager.prepare_forward: adapters resident, segments built, metadata copied
  body               ModelRunner.run_body: for a graph, its inputs loaded and the replay launched
    body.tokens      the graph's static input buffers filled (decode: GraphBuffers.load_tokens)
    body.attn        the attention backend's replay metadata
    body.launch      torch.cuda.CUDAGraph.replay (the launch only: the GPU runs it asynchronously)
  tail               ModelRunner.run_eager_tail: logits, sampling, the copy to the host
    tail.to_host     the device -> host copy, which waits for the GPU to finish the forward

`tail` minus `tail.to_host` is the tail's launches; `tail.to_host` mostly the GPU's remaining work.
The timers wrap instance attributes for the duration of `measure` and restore them after.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

PHASES = ("prepare", "prepare.lora", "body", "body.tokens", "body.attn", "body.launch", "tail", "tail.to_host")


class PhaseTimers:
    """perf_counter totals (seconds) per phase label, gathered by the functions `wrap` returns."""

    def __init__(self, phases: Sequence[str] = PHASES) -> None:
        self.totals = dict.fromkeys(phases, 0.0)

    def wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        totals = self.totals

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[phase] += time.perf_counter() - t0

        return timed


@contextlib.contextmanager
def patched(targets: list[tuple[Any, str, str]], timers: PhaseTimers) -> Iterator[None]:
    """Wrap `obj.name` for each (obj, name, phase) while the block runs, then restore it: on an
    instance, an attribute shadowing the method; on a module, the module's function."""
    undo = []
    try:
        for obj, name, phase in targets:
            had_own = name in vars(obj)
            undo.append((obj, name, had_own, vars(obj).get(name)))
            setattr(obj, name, timers.wrap(phase, getattr(obj, name)))
        yield
    finally:
        for obj, name, had_own, own in reversed(undo):
            if had_own:
                setattr(obj, name, own)
            else:
                delattr(obj, name)


def _targets(runner: Any) -> list[tuple[Any, str, str]]:
    targets = [(runner, "prepare", "prepare"), (runner, "run_body", "body"), (runner, "run_eager_tail", "tail"),
               (runner, "_to_host", "tail.to_host"), (runner.attn_backend, "init_forward_metadata_replay_cuda_graph",
                                                      "body.attn")]
    if getattr(runner, "lora_manager", None) is not None:
        targets.append((runner.lora_manager, "prepare_forward", "prepare.lora"))
    for graph_runner in {id(g): g for g in (getattr(runner, "decode_graph_runner", None),
                                            getattr(runner, "base_decode_graph_runner", None)) if g is not None}.values():
        buffers = getattr(graph_runner, "buffers", None)
        if buffers is not None and hasattr(buffers, "load_tokens"):
            targets.append((buffers, "load_tokens", "body.tokens"))
    return targets


def measure(runner: Any, fwd: Callable[[], Any], n: int, device: Optional[torch.device] = None) -> dict[str, float]:
    """Per-forward host µs of each phase (PHASES) over `n` calls of `fwd`, plus "wall"."""
    timers = PhaseTimers()
    cls_replay = torch.cuda.CUDAGraph.replay
    on_cuda = device is not None and device.type == "cuda"
    wall = 0.0
    with patched(_targets(runner), timers):
        torch.cuda.CUDAGraph.replay = timers.wrap("body.launch", cls_replay)
        try:
            for _ in range(n):
                if on_cuda:
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                fwd()
                if on_cuda:
                    torch.cuda.synchronize(device)
                wall += time.perf_counter() - t0
        finally:
            torch.cuda.CUDAGraph.replay = cls_replay
    out = {phase: total / n * 1e6 for phase, total in timers.totals.items()}
    out["wall"] = wall / n * 1e6
    return out


def summary(phases: dict[str, float]) -> str:
    """One line: the phases in µs, the tail's launches apart from its wait for the GPU."""
    p = phases
    return (f"prepare {p['prepare']:.0f} (LoRA {p['prepare.lora']:.0f}) · body {p['body']:.0f} (tokens "
            f"{p['body.tokens']:.0f}, attention metadata {p['body.attn']:.0f}, graph launch {p['body.launch']:.0f}) · "
            f"tail launches {p['tail'] - p['tail.to_host']:.0f} · to host (waits for the GPU) {p['tail.to_host']:.0f} "
            f"· wall {p['wall']:.0f}")
