"""Small helpers shared across layers. Hardware probes are functions so tests can patch them."""

from __future__ import annotations

import logging
import os
import random
import socket
from typing import Optional

logger = logging.getLogger(__name__)


def is_cuda() -> bool:
    """True when a CUDA device is usable (patchable in tests)."""
    try:
        import torch

        return torch.cuda.is_available() and torch.version.cuda is not None
    except Exception:  # pragma: no cover - torch missing or broken
        return False


def is_hip() -> bool:
    try:
        import torch

        return torch.version.hip is not None
    except Exception:  # pragma: no cover
        return False


def is_npu() -> bool:
    return False  # no Ascend support in this engine


def is_xpu() -> bool:
    try:
        import torch

        return hasattr(torch, "xpu") and torch.xpu.is_available()
    except Exception:  # pragma: no cover
        return False


def is_mps() -> bool:
    try:
        import torch

        return torch.backends.mps.is_available()
    except Exception:  # pragma: no cover
        return False


def is_cpu() -> bool:
    """True when no accelerator is present (the CPU is the device)."""
    return not (is_cuda() or is_hip() or is_xpu() or is_mps() or is_npu())


def configure_logger(log_level: str = "info", prefix: str = "") -> None:
    fmt = f"[%(asctime)s{prefix}] %(message)s"
    logging.basicConfig(
        level=getattr(logging, log_level.upper(), logging.INFO),
        format=fmt,
        datefmt="%Y-%m-%d %H:%M:%S",
        force=True,
    )


def set_random_seed(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def get_free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def parse_dist_init_addr(addr: str) -> tuple[str, int]:
    """--dist-init-addr 'host:port' (IPv6 as '[::1]:port') -> (host, port)."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--dist-init-addr must be HOST:PORT, got {addr!r}")
    return host.strip("[]"), int(port)


def get_cache_dir() -> str:
    """Where the demo checkpoint and adapters are materialised ($SGLANG_CACHE_DIR)."""
    return os.environ.get("SGLANG_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "sglang"
    )


def get_available_gpu_memory(device: int = 0) -> float:
    """Free device memory in GiB (after emptying the caching allocator's cache)."""
    import torch

    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    return free / (1 << 30)


def get_available_host_memory() -> Optional[int]:
    """Bytes of host memory a new allocation can take without swapping (Linux's MemAvailable), or
    None where the system does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def env_flag(name: str, default: bool = False) -> bool:
    value: Optional[str] = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


def package_version() -> str:
    """The installed distribution's version (the source tree's when it is not installed)."""
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # noqa: BLE001 - running from a source checkout
        return "0.1.0"


class CumulativeHistogram:
    """Observations counted into fixed buckets (Prometheus' cumulative layout, `+Inf` last), kept
    where they happen (e.g. the scheduler process) and shipped as plain data to whoever exports them."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)  # per bucket, not yet cumulative; the last: +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        i = next((i for i, b in enumerate(self.buckets) if value <= b), len(self.buckets))
        self.counts[i] += 1
        self.total += value

    def to_dict(self) -> dict:
        """{"buckets": [[le, cumulative count], ..., ["+Inf", count]], "sum": ...}."""
        out, running = [], 0
        for le, n in zip([*self.buckets, "+Inf"], self.counts):
            running += n
            out.append([le, running])
        return {"buckets": out, "sum": self.total}


def stacked_view(*vectors: "torch.Tensor") -> "Optional[torch.Tensor]":
    """A [k, n] view of k contiguous 1-D tensors of n elements that lie back to back, in this
    order, in one storage (same dtype and device); None when they do not.

    The batch builders move a batch's int64 vectors to the device in one packed copy
    (model_executor/batch_builder.py), so consecutive fields are such neighbours. Copying them
    into a graph's static buffers as one [k, n] block is one copy where there were k: on the H200
    host each copy costs ~25-35 µs of a decode step's host time, before the graph can start.
    """
    first = vectors[0]
    if first.dim() != 1 or not first.is_contiguous():
        return None
    n, storage = first.numel(), first.untyped_storage().data_ptr()
    step = n * first.element_size()
    for i, v in enumerate(vectors[1:], 1):
        if (v.dim() != 1 or v.numel() != n or v.dtype != first.dtype or v.device != first.device
                or not v.is_contiguous() or v.untyped_storage().data_ptr() != storage
                or v.data_ptr() != first.data_ptr() + i * step):
            return None
    return first.as_strided((len(vectors), n), (n, 1))
