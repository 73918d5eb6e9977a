"""Small host -> device copies that never make the host wait for the device.

A plain `.to("cuda")` of a pageable tensor blocks until every kernel queued before it has run: in
the scheduler that is the whole step in flight. From pinned memory with `non_blocking=True` the
copy is queued on the current stream, ahead of the kernels that read it, and the call returns at
once; PyTorch's caching host allocator keeps a pinned block until the copies that used it are done,
so a fresh one per call is safe.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch


def to_device(values: Union[Sequence[int], Sequence[float], torch.Tensor], dtype: torch.dtype,
              device: torch.device | str) -> torch.Tensor:
    """A tensor on `device` holding `values` (nested sequences give a tensor of their shape); a
    host tensor given for a CPU device may come back as it is."""
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
