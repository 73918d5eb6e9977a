"""Decode CUDA graphs: one graph per batch-size bucket (DESIGN §6).

`full` (default) captures the whole body including attention, whose metadata lives in the attention
backend's static buffers; `breakable` breaks the body at attention like the breakable prefill graph.
With LoRA kernels (`capture_lora=True`), the decode `LoRABatchInfo` is allocated once
(`init_cuda_graph_batch_info`) and refreshed in place before each replay (the manager's
`prepare_forward` with the DECODE_GRAPH path); capture uses `lora_ids=[None] * bs`, so every LoRA
kernel is recorded and idle. A LoRA server also holds a runner without them (`capture_lora=False`,
captured with the LoRA backend's `batch_info` None) for all-base batches. What both graph runners
share: graph_runner.py.

A live batch of `bs` requests is padded to the smallest bucket >= bs. Padded rows point at the dummy
request row, write their K/V to slot 0 and are dropped before the eager tail.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from sglang.srt.configs.cuda_graph_config import Backend, decode_bucket_ladder
from sglang.srt.configs.forward_batch_info import ForwardBatch
from sglang.srt.configs.forward_path import ForwardPath
from sglang.srt.model_executor.runner.graph_buffers import pick_bucket
from sglang.srt.model_executor.runner.graph_runner import GraphHost, GraphRunnerBase

DEFAULT_MAX_DECODE_GRAPH_BS = 160


def decode_graph_max_bs(model_runner: GraphHost) -> int:
    cfg = model_runner.config.cuda_graph.decode
    if cfg.bs:
        return max(cfg.bs)
    return min(cfg.max_bs or DEFAULT_MAX_DECODE_GRAPH_BS, model_runner.max_running_requests)


class CudaGraphRunner(GraphRunnerBase):
    kind = "decode"
    path = ForwardPath.DECODE_GRAPH

    def __init__(
        self, model_runner: GraphHost, backend: Backend, capture_lora: bool, capture: bool = True
    ) -> None:
        """`capture=False` allocates without capturing (see PrefillCudaGraphRunner)."""
        assert backend in (Backend.FULL, Backend.BREAKABLE)
        super().__init__(model_runner, backend, capture_lora)
        cfg = model_runner.config.cuda_graph.decode
        self.max_bs = decode_graph_max_bs(model_runner)
        self.buckets = sorted(set(cfg.bs)) if cfg.bs else decode_bucket_ladder(self.max_bs)
        if capture_lora:
            model_runner.lora_manager.init_cuda_graph_batch_info(self.max_bs, 1, self.buckets)
        self._allocate(self.max_bs, self.max_bs)
        self.seq_len_fill = model_runner.attn_backend.get_cuda_graph_seq_len_fill_value()
        if capture:
            self.capture()

    def refusal(self, fb: ForwardBatch) -> Optional[str]:
        """Why this batch cannot replay a decode graph (None: it can)."""
        if not fb.forward_mode.is_decode():
            return "not_decode"
        return "too_many_requests" if fb.batch_size > self.max_bs else None

    def graph_plan(self) -> dict[str, Any]:
        """Everything `can_run` and the capture depend on (the same on every TP rank)."""
        return {"kind": "decode", "backend": self.backend.value, "capture_lora": self.capture_lora,
                "max_bs": self.max_bs, "buckets": list(self.buckets)}

    # ---------------------------------------------------------------------------- capture
    def _capture_batch(self, bs: int) -> ForwardBatch:
        fb = self.buffers.capture_decode_batch(bs, self.seq_len_fill, with_lora=self.enable_lora)
        return self._prepare_capture(fb, bs)

    # ---------------------------------------------------------------------------- replay
    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        mr = self.model_runner
        bs = fb.batch_size
        bucket = pick_bucket(self.buckets, bs)
        self.buffers.load_tokens(fb, bucket)
        graph = self.graphs[bucket]
        if self.backend == Backend.FULL:
            mr.attn_backend.init_forward_metadata_replay_cuda_graph(
                bs, fb.req_pool_indices, fb.seq_lens, fb.seq_lens_cpu, fb.forward_mode, fb
            )
            graph.replay()
        else:
            static_fb = self.buffers.padded_view(fb, bucket)
            mr.attn_backend.init_forward_metadata(static_fb)
            graph.replay(static_fb)
        self.num_replays += 1
        return self.hidden_out[:bs]
