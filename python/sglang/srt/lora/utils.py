"""LoRA batch metadata shared by the backends and their kernels (DESIGN §5)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class LoRABatchInfo:
    """Which adapter slot each segment of tokens uses.

    A *segment* is a run of consecutive tokens (in the order the kernels read them) that share one
    adapter slot: one request for the `triton` backend, one chunk of adapter-sorted tokens for
    `csgmv`. Every tensor here lives on the device and is read by the kernels; the Python ints are
    launch dimensions. Under a CUDA graph the launch dimensions are frozen at capture, so:
      - `bs` is the size of the segment grid axis (triton: the static slot count, e.g. 32);
      - unused segments have length 0 and the kernels return for them;
      - slot ranks come from `lora_ranks[weight_indices[seg]]`, and a rank of 0 (the base model's
        slot) makes every kernel return at once.
    """

    bs: int  # size of the grid's segment axis
    num_segments: int  # live segments (<= bs); informational under graphs
    max_len: int  # longest segment (triton) or chunk size (csgmv): the grid's token axis
    seg_indptr: torch.Tensor  # int32 [bs + 1]: CSR token offsets, seg_indptr[0] == 0
    weight_indices: torch.Tensor  # int32 [bs]: pool slot of each segment
    lora_ranks: torch.Tensor  # int32 [num_slots]: rank of the adapter in each slot, 0 = none
    scalings: torch.Tensor  # float32 [num_slots]: alpha / r (or alpha / sqrt(r) for rsLoRA)
    seg_lens: Optional[torch.Tensor] = None  # int32 [bs] (triton)
    permutation: Optional[torch.Tensor] = None  # int32/int64 [T]: sorted position -> token row (csgmv)
    use_cuda_graph: bool = False  # metadata lives in static buffers a graph reads
