"""The one decision of a forward: which path runs the model body, and whether LoRA kernels run.

ModelRunner.choose_forward_path makes it once per forward (DESIGN §6); the same `ForwardPlan`
goes to the LoRA manager, which goes on handing its `path` to the backend, so the metadata is
written exactly where the chosen path reads it and nobody re-derives the choice.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ForwardPath(str, enum.Enum):
    """A str too, so logs, metrics and messages between processes read it as its value."""

    EAGER = "eager"  # the body runs op by op on the live batch
    DECODE_GRAPH = "decode_graph"  # a decode CUDA graph replays it
    PREFILL_GRAPH = "prefill_graph"  # a prefill CUDA graph (breakable or full) replays it

    @property
    def is_graph(self) -> bool:
        return self is not ForwardPath.EAGER


@dataclass(frozen=True)
class ForwardPlan:
    """`lora`: the batch has adapter requests, so the LoRA kernels run (a graph path then replays
    the graph set captured with them). A batch of base requests only runs without them."""

    path: ForwardPath
    lora: bool = False
