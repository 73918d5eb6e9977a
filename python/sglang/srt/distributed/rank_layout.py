"""Which tensor-parallel ranks this node runs, and what each rank process needs to join its group.

`--tp-size N --nnodes M --node-rank k` puts ranks [k*N/M, (k+1)*N/M) on node k; rank r uses the
GPU `r mod N/M` of its node. Rank 0 (node 0) talks to the tokenizer manager. The group meets at
`--dist-init-addr` (required with several nodes), else at a free port on this host.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import MutableMapping, Optional

from sglang.srt.configs.run_configs import TPLayout
from sglang.srt.utils import get_free_port, parse_dist_init_addr

# NVLink multicast (NVLS) stays off in every process the server starts (DESIGN §11); a value the
# user set explicitly is kept.
NVLINK_MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def disable_nvlink_multicast(environ: MutableMapping[str, str] = os.environ) -> None:
    for key, value in NVLINK_MULTICAST_OFF.items():
        environ.setdefault(key, value)


@dataclass(frozen=True)
class RankSpec:
    """One rank process's place in the group (picklable: it travels to the spawned process)."""

    tp_rank: int
    tp_size: int
    local_rank: int  # the GPU index on this node
    backend: str  # "nccl" (CUDA) or "gloo" (CPU)
    init_method: Optional[str] = None  # tcp://host:port; None at tp_size 1
    timeout_s: Optional[float] = None  # collectives and rendezvous; None = torch's default

    @property
    def name(self) -> str:
        return f"TP rank {self.tp_rank}"


def plan_local_ranks(layout: TPLayout) -> list[RankSpec]:
    """The ranks this node starts, in rank order."""
    tp, nnodes, node, device = layout.size, layout.nnodes, layout.node_rank, layout.device
    backend = "nccl" if device == "cuda" else "gloo"
    per_node = layout.ranks_per_node
    if device == "cuda" and tp > 1:
        import torch

        available = torch.cuda.device_count()
        if per_node > available:
            raise ValueError(
                f"--tp-size {tp} over {nnodes} node(s) needs {per_node} GPUs on this node; "
                f"{available} are visible"
            )
    init_method = None
    if tp > 1:
        if layout.dist_init_addr:
            host, port = parse_dist_init_addr(layout.dist_init_addr)
        else:
            host, port = "127.0.0.1", get_free_port()
        init_method = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
    timeout = float(layout.dist_timeout) if layout.dist_timeout else None
    first = node * per_node
    return [
        RankSpec(tp_rank=first + i, tp_size=tp, local_rank=i, backend=backend, init_method=init_method,
                 timeout_s=timeout)
        for i in range(per_node)
    ]
