"""What `ModelRunner.forward` returns to the scheduler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

# One top-k list: (logprobs, token ids), both of length k.
TopLogprobs = tuple[list[float], list[int]]


@dataclass
class ModelRunnerOutput:
    next_token_ids: torch.Tensor  # int64 [B] on the host
    # Logprob of each sampled token under the model's (untempered) distribution; only when asked.
    next_token_logprobs: Optional[list[float]] = None
    next_token_top_logprobs: Optional[list[Optional[TopLogprobs]]] = None
    # Per request, the prompt logprobs computed in this pass (EXTEND only): for request i, one value
    # per entry of forward_batch.extend_logprob_target_ids[i]; None for requests that did not ask.
    input_token_logprobs: Optional[list[Optional[list[float]]]] = None
    input_top_logprobs: Optional[list[Optional[list[TopLogprobs]]]] = None
    # Whether a CUDA graph (decode, or prefill breakable/full) served this forward.
    used_cuda_graph: bool = False
