"""Tensor parallelism: process groups, collectives and the rank layout (DESIGN §11). How a model
splits over the ranks is plain data (configs/tp_split.py)."""

from sglang.srt.distributed.parallel_state import (
    SINGLE_RANK,
    TensorParallelGroup,
    destroy_tensor_parallel,
    init_tensor_parallel,
)
from sglang.srt.distributed.rank_layout import (
    NVLINK_MULTICAST_OFF,
    RankSpec,
    disable_nvlink_multicast,
    plan_local_ranks,
)

__all__ = [
    "NVLINK_MULTICAST_OFF",
    "SINGLE_RANK",
    "RankSpec",
    "TensorParallelGroup",
    "destroy_tensor_parallel",
    "disable_nvlink_multicast",
    "init_tensor_parallel",
    "plan_local_ranks",
]
