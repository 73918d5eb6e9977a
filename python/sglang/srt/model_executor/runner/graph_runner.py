"""What the decode and prefill graph runners share: the model runner's side they read
(`GraphHost`), the static buffers, capturing every bucket largest first, the capture batch's
attention and LoRA set-up, and the body they record.

A runner records the body (`model.model`) only; the lm_head, logprobs and sampling run in the
eager tail. With LoRA kernels (`capture_lora`), the capture batch takes the graph path's static
LoRA metadata with every request on the base model (rank 0: every kernel recorded, all idle); the
set without them is captured with the LoRA backend's `batch_info` cleared, so every wrapper
records its base layer alone.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

import torch
from torch import nn
from tqdm import tqdm

from sglang.srt.configs.cuda_graph_config import Backend
from sglang.srt.configs.forward_batch_info import ForwardBatch
from sglang.srt.configs.forward_path import ForwardPath, ForwardPlan
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.configs.run_configs import RunnerConfig
from sglang.srt.model_executor.runner.breakable_cuda_graph import BreakOutputs
from sglang.srt.model_executor.runner.graph_buffers import GraphInputBuffers
from sglang.srt.model_executor.runner.graph_capture import AnyGraph, capture_graph

if TYPE_CHECKING:
    from sglang.srt.lora.lora_manager import LoRAManager
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

logger = logging.getLogger(__name__)


class GraphHost(Protocol):
    """The parts of the ModelRunner a graph runner reads (it never calls back into the forward)."""

    config: RunnerConfig
    device: torch.device
    dtype: torch.dtype
    model: nn.Module
    model_config: ModelConfig
    attn_backend: Any
    lora_manager: Optional["LoRAManager"]
    req_to_token_pool: "ReqToTokenPool"
    padding_req_pool_index: int
    context_len: int
    max_running_requests: int
    graph_memory_pool: Any
    graph_capture_stream: Any

    def attach_pools(self, fb: ForwardBatch) -> None: ...


class GraphRunnerBase:
    kind: str  # "decode" or "prefill": logs and graph plans
    path: ForwardPath  # the forward path this runner replays (the LoRA metadata it captures with)

    def __init__(self, model_runner: GraphHost, backend: Backend, capture_lora: bool) -> None:
        self.model_runner = model_runner
        self.backend = backend
        self.enable_lora = model_runner.lora_manager is not None
        # This runner records LoRA kernels only if the LoRA backend serves them from static metadata.
        assert not capture_lora or (self.enable_lora and model_runner.lora_manager.supports_prefill_cuda_graph)
        self.capture_lora = capture_lora
        # What the captured graphs run: the model body (tc_piecewise: its compiled pieces).
        self.body: Callable[..., torch.Tensor] = model_runner.model.model
        self.buckets: list[int] = []
        self.graphs: dict[int, AnyGraph] = {}
        # The breakable graphs' break outputs, one buffer for every bucket (captured largest first).
        self.break_outputs = BreakOutputs()
        self.num_replays = 0

    @property
    def breakable(self) -> bool:
        """Captured as segments broken at attention (breakable, tc_piecewise), or whole (full)."""
        return self.backend in (Backend.BREAKABLE, Backend.TC_PIECEWISE)

    def _allocate(self, max_tokens: int, req_slots: int) -> None:
        """The static inputs, the full backend's attention state, and the body's output buffer."""
        mr = self.model_runner
        self.buffers = GraphInputBuffers.allocate(max_tokens, req_slots, mr.device, mr.padding_req_pool_index)
        if self.backend == Backend.FULL:
            mr.attn_backend.init_cuda_graph_state(req_slots, max_tokens)
        self.hidden_out = torch.empty((max_tokens, mr.model_config.hidden_size), dtype=mr.dtype, device=mr.device)

    # ---------------------------------------------------------------------------- eligibility
    def refusal(self, fb: ForwardBatch) -> Optional[str]:
        """Why this batch cannot replay one of these graphs (None: it can)."""
        raise NotImplementedError

    def can_run(self, fb: ForwardBatch) -> bool:
        return self.refusal(fb) is None

    # ---------------------------------------------------------------------------- capture
    def capture(self) -> None:
        """Capture every bucket's graph, largest first (smaller buckets reuse its memory). Every
        TP rank captures the same buckets in the same order: the all-reduces inside the body pair
        up across ranks."""
        mr = self.model_runner
        bar = tqdm(sorted(self.buckets, reverse=True), desc=f"Capturing {self.kind} CUDA graphs ({self.backend.value})",
                   unit="bucket")
        for n in bar:
            free_gib = torch.cuda.mem_get_info(mr.device)[0] / (1 << 30)
            bar.set_postfix_str(f"{n} free={free_gib:.1f}GiB")
            fb = self._capture_batch(n)
            self.graphs[n] = capture_graph(
                self.breakable, lambda: self._run_body(fb, n), fb, mr.graph_memory_pool,
                mr.graph_capture_stream, self.break_outputs,
            )
        torch.cuda.synchronize(mr.device)
        logger.info(
            "Captured %d %s CUDA graphs (%s, buckets %s..%s, LoRA %s).", len(self.buckets), self.kind,
            self.backend.value, self.buckets[0], self.buckets[-1],
            "kernels captured" if self.capture_lora else ("set without LoRA" if self.enable_lora else "off"),
        )

    def _capture_batch(self, n: int) -> ForwardBatch:
        """The batch bucket `n` is captured with, its attention and LoRA metadata set."""
        raise NotImplementedError

    def _prepare_capture(self, fb: ForwardBatch, num_tokens: int) -> ForwardBatch:
        mr = self.model_runner
        mr.attach_pools(fb)
        if self.backend == Backend.FULL:
            mr.attn_backend.init_forward_metadata_capture_cuda_graph(
                fb.batch_size, num_tokens, fb.req_pool_indices, fb.seq_lens, fb.forward_mode, fb
            )
        else:
            mr.attn_backend.init_forward_metadata(fb)
        if self.enable_lora:
            # With LoRA kernels: this path's static metadata, every request on the base model.
            # Without: `batch_info` cleared, every wrapper records its base layer only.
            mr.lora_manager.prepare_forward(fb, ForwardPlan(self.path, lora=self.capture_lora))
        return fb

    def _run_body(self, fb: ForwardBatch, n: int) -> None:
        hidden = self.body(fb.input_ids, fb.positions, fb)
        self.hidden_out[:n].copy_(hidden)
