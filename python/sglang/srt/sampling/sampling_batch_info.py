"""Per-batch sampling parameters as device tensors, built by the scheduler, read by the Sampler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.sampling.grammar_mask import GrammarMask
from sglang.srt.sampling.logit_adjustments import LogitAdjustments


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
    # Penalties and biases applied to the logits before the choice (greedy rows included).
    adjustments: Optional[LogitAdjustments] = None
    # The grammar mask of the constrained rows (constrained decoding), applied after the adjustments.
    grammar: Optional[GrammarMask] = None

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
        adjustments: Optional[LogitAdjustments] = None,
        grammar: Optional[GrammarMask] = None,
    ) -> "SamplingBatchInfo":
        # Two host->device copies (the float parameters packed, the int ones), not four; from
        # pinned memory on CUDA, so building the batch never waits for the device.
        floats = torch.tensor([temperatures, top_ps, min_ps], dtype=torch.float32)
        ints = torch.tensor(top_ks, dtype=torch.int64)
        if torch.device(device).type == "cuda":
            floats, ints = floats.pin_memory(), ints.pin_memory()
        floats = floats.to(device, non_blocking=True)
        ints = ints.to(device, non_blocking=True)
        return cls(
            temperatures=floats[0].view(-1, 1),
            top_ps=floats[1],
            top_ks=ints,
            min_ps=floats[2],
            is_all_greedy=all(t <= 0 for t in temperatures),
            need_top_p_sampling=any(p < 1.0 for p in top_ps),
            need_top_k_sampling=any(k > 0 for k in top_ks),
            need_min_p_sampling=any(p > 0 for p in min_ps),
            seeds=seeds if any(s is not None for s in seeds) else None,
            steps=steps,
            adjustments=adjustments,
            grammar=grammar,
        )
