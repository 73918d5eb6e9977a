"""The `tc_piecewise` prefill graph's body: the model body compiled with torch.compile (inductor),
attention left to run as written.

Attention is an opaque custom op under compile (layers/radix_attention.py), so Dynamo traces the
body as one graph and inductor fuses everything around attention: norms with their residual adds,
the activation with its product, the rotary embedding (while Dynamo traces, the fused layers take
their torch paths, layers/triton_ops/dispatch.py). At run time the compiled code calls the op,
which runs attention eagerly: during the runner's capture that breaks the CUDA graph there,
exactly as the breakable graph does, so the compiled stretches between attention calls become the
captured segments, and attention runs on the live batch at replay.

One compilation serves every bucket (dynamic token count; the 1-token bucket is specialised on its
own). Inductor's on-disk caches live in $SGLANG_CACHE_DIR/inductor, so a restart compiles from the
cache. Compiled code rounds differently from the eager layers: a tc_piecewise replay matches eager
within the end-to-end tolerance of compiled paths, not bit for bit (breakable and full do). LoRA
servers do not use it: Dynamo cannot follow per-batch LoRA metadata.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

import torch
from torch import nn

from sglang.srt.configs.cuda_graph_config import TORCH_COMPILE_MODES
from sglang.srt.configs.forward_batch_info import ForwardBatch
from sglang.srt.layers.radix_attention import RadixAttention, attention_context
from sglang.srt.utils import get_cache_dir

logger = logging.getLogger(__name__)

# Graph variants Dynamo may keep (the 1-token bucket, the others; headroom for a guard that fails).
RECOMPILE_LIMIT = 16


def compile_body(model: nn.Module, compile_mode: str | None = None) -> Callable[..., torch.Tensor]:
    """(input_ids, positions, forward_batch) -> hidden, through `model.model` compiled."""
    assert compile_mode in TORCH_COMPILE_MODES, compile_mode  # resolve_cuda_graph_flags checked it
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(get_cache_dir(), "inductor"))
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    layers = {m.layer_id: m for m in model.modules() if isinstance(m, RadixAttention)}
    compiled = torch.compile(model.model, dynamic=True, fullgraph=True, mode=TORCH_COMPILE_MODES[compile_mode])
    logger.info("tc_piecewise: the body compiles around %d attention calls (mode %s, cache %s)", len(layers),
                compile_mode or "default", os.environ["TORCHINDUCTOR_CACHE_DIR"])

    def body(input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        with attention_context(forward_batch, layers):
            return compiled(input_ids, positions, forward_batch)

    return body
