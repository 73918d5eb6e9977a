"""Tensor parallelism: process groups, collectives, rank layout and model-split checks (DESIGN §11)."""

from sglang.srt.distributed.parallel_state import (
    SINGLE_RANK,
    TensorParallelGroup,
    building_model,
    current_tp_group,
    destroy_tensor_parallel,
    init_tensor_parallel,
    resolve_tp_group,
)
from sglang.srt.distributed.rank_layout import (
    NVLINK_MULTICAST_OFF,
    RankSpec,
    disable_nvlink_multicast,
    plan_local_ranks,
)
from sglang.srt.distributed.tp_split import TPSplit, check_tensor_parallel, tp_split

__all__ = [
    "NVLINK_MULTICAST_OFF",
    "SINGLE_RANK",
    "RankSpec",
    "TPSplit",
    "TensorParallelGroup",
    "building_model",
    "check_tensor_parallel",
    "current_tp_group",
    "destroy_tensor_parallel",
    "disable_nvlink_multicast",
    "init_tensor_parallel",
    "plan_local_ranks",
    "resolve_tp_group",
    "tp_split",
]
