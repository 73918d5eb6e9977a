"""Per-batch sampling parameters as device tensors, built by the scheduler, read by the Sampler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class SamplingBatchInfo:
    temperatures: torch.Tensor  # float32 [B, 1]; 0 means greedy for that request
    top_ps: torch.Tensor  # float32 [B]
    top_ks: torch.Tensor  # int64 [B]; -1 or >= vocab means no top-k
    min_ps: torch.Tensor  # float32 [B]
    is_all_greedy: bool
    need_top_p_sampling: bool
    need_top_k_sampling: bool
    need_min_p_sampling: bool
    # Per-request seed (None = the global generator) and how many tokens the request has generated,
    # so a seeded request draws the same noise at step k whatever batch it is in.
    seeds: Optional[list[Optional[int]]] = None
    steps: Optional[list[int]] = None

    @classmethod
    def from_params(
        cls,
        temperatures: list[float],
        top_ps: list[float],
        top_ks: list[int],
        min_ps: list[float],
        seeds: list[Optional[int]],
        steps: list[int],
        device: torch.device | str,
    ) -> "SamplingBatchInfo":
        return cls(
            temperatures=torch.tensor(temperatures, dtype=torch.float32, device=device).view(-1, 1),
            top_ps=torch.tensor(top_ps, dtype=torch.float32, device=device),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            min_ps=torch.tensor(min_ps, dtype=torch.float32, device=device),
            is_all_greedy=all(t <= 0 for t in temperatures),
            need_top_p_sampling=any(p < 1.0 for p in top_ps),
            need_top_k_sampling=any(k > 0 for k in top_ks),
            need_min_p_sampling=any(p > 0 for p in min_ps),
            seeds=seeds if any(s is not None for s in seeds) else None,
            steps=steps,
        )
