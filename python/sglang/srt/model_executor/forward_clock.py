"""The time forwards take, by phase (`SGLANG_FORWARD_TIMES=1`): where a serving run's GPU time went.

A forward's time is the span from an event recorded when it is launched to one recorded after its
outputs' host copies, on the forward's stream: stream time, so a step launched behind another (the
overlap schedule) counts from when the stream reaches it, not from its launch, and the host's own
work between steps is not counted. On the CPU, whose forward is synchronous, it is the call's wall
time. The sums appear in /get_server_info as `forward_seconds` (a benchmark reads their change over
its load). Off by default: two events per forward and a wait on the second when the forward is
finished, which the outputs' copies have already made.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from sglang.srt.configs.forward_batch_info import ForwardBatch

Mark = Union[torch.cuda.Event, float]


@dataclass
class ForwardClock:
    enabled: bool
    device: torch.device
    seconds: dict[str, float] = field(default_factory=lambda: {"prefill": 0.0, "decode": 0.0})
    forwards: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})

    def mark(self) -> Optional[Mark]:
        """A point on the forward's stream (None when the clock is off)."""
        if not self.enabled:
            return None
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, fb: ForwardBatch, start: Optional[Mark], end: Optional[Mark]) -> None:
        """Count the span of a finished forward (its outputs on the host: `end` has been reached)."""
        if start is None or end is None:
            return
        if isinstance(start, torch.cuda.Event):
            end.synchronize()  # recorded right after the copies the caller has waited for
            seconds = start.elapsed_time(end) / 1e3
        else:
            seconds = end - start
        phase = "prefill" if fb.forward_mode.is_extend() else "decode"
        self.seconds[phase] += seconds
        self.forwards[phase] += 1

    def stats(self) -> Optional[dict[str, float]]:
        if not self.enabled:
            return None
        return {**{f"{p}_s": round(s, 6) for p, s in self.seconds.items()},
                **{f"{p}_forwards": n for p, n in self.forwards.items()}}
