"""Host -> device copies of LoRA metadata without a device sync.

On CUDA the host tensor is pinned and copied with `non_blocking=True`: the copy is queued on the
current stream ahead of the kernels (or graph replay) that read it. A fresh pinned tensor per call
is safe because PyTorch's caching host allocator does not recycle pinned blocks until the copies
that used them have completed.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch

HostValues = Union[Sequence[int], Sequence[float], torch.Tensor]


def _host_tensor(values: HostValues, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        host = host.pin_memory()
    return host


def to_device(values: HostValues, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A fresh device tensor holding `values`."""
    host = _host_tensor(values, dtype, device)
    if device.type == "cpu":
        return host.clone() if isinstance(values, torch.Tensor) else host
    return host.to(device, non_blocking=True)


def copy_into(dst: torch.Tensor, values: HostValues) -> None:
    """Overwrite the (static) device tensor `dst` in place with `values` (same length)."""
    host = _host_tensor(values, dst.dtype, dst.device)
    assert host.numel() == dst.numel(), (host.numel(), dst.numel())
    dst.copy_(host.view(dst.shape), non_blocking=True)
