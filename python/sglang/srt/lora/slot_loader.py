"""Copying adapters into pool slots without stalling the forward.

On CUDA every copy into a slot is issued on the loader's side stream, after the work already
queued on the forward's stream (which may still read the slot's previous adapter), and an event
is recorded after it. Before a batch that uses the slot runs, the forward's stream waits on that
event (`wait_for`): a wait on the device, never a host sync. A load issued for an adapter that
waiting requests will need (a prefetch) therefore runs while the forward in flight computes. The
host copies are pinned when the adapter is loaded (lora.py), so the copies are asynchronous DMA.

On the CPU the copies run at once, in order, and there is nothing to wait for.

Only the slot views `pool.A_buffer[module][layer][slot]` / `pool.B_buffer[module][layer][slot]`
are written, so the pool's buffer layout is free to change behind them.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator, Optional

import torch


class SlotLoader:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream: Optional[torch.cuda.Stream] = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pending: dict[int, torch.cuda.Event] = {}  # slot -> its last load's completion

    @contextmanager
    def writing(self, slot: int) -> Iterator[None]:
        """The context in which a slot's copies are issued (the side stream on CUDA)."""
        if self.stream is None:
            yield
            return
        # Write-after-read: earlier forwards may still read the adapter this slot held.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield
        event = torch.cuda.Event()
        event.record(self.stream)
        self._pending[slot] = event

    def wait_for(self, slots: Iterable[int]) -> None:
        """Make the current stream's next work wait until these slots' loads are done."""
        if not self._pending:
            return
        current = torch.cuda.current_stream(self.device)
        for slot in slots:
            event = self._pending.pop(slot, None)
            if event is not None:
                current.wait_event(event)

    def pending_slots(self) -> list[int]:
        return sorted(self._pending)
