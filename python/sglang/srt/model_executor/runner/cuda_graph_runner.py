"""Decode CUDA graphs: one graph per batch-size bucket (DESIGN §6).

`full` (default) captures the whole body including attention, whose metadata lives in the attention
backend's static buffers; `breakable` breaks the body at attention like the breakable prefill graph.
With LoRA kernels (`capture_lora=True`), the decode `LoRABatchInfo` is allocated once
(`init_cuda_graph_batch_info`) and refreshed in place before each replay by
`prepare_lora_batch(use_cuda_graph=True)`; capture uses `lora_ids=[None] * bs`, so every LoRA kernel
is recorded and idle. A LoRA server also holds a runner without them (`capture_lora=False`,
captured with the LoRA backend's `batch_info` None) for all-base batches.

A live batch of `bs` requests is padded to the smallest bucket >= bs. Padded rows point at the dummy
request row, write their K/V to slot 0 and are dropped before the eager tail.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

import torch
from tqdm import tqdm

from sglang.srt.model_executor.cuda_graph_config import Backend, decode_bucket_ladder
from sglang.srt.configs.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.runner.breakable_cuda_graph import BreakOutputs
from sglang.srt.model_executor.runner.graph_capture import AnyGraph, capture_graph
from sglang.srt.model_executor.runner.graph_buffers import GraphInputBuffers, pick_bucket

if TYPE_CHECKING:
    from sglang.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

DEFAULT_MAX_DECODE_GRAPH_BS = 160


def decode_graph_max_bs(model_runner: "ModelRunner") -> int:
    cfg = model_runner.server_args.cuda_graph_config.decode
    if cfg.bs:
        return max(cfg.bs)
    return min(cfg.max_bs or DEFAULT_MAX_DECODE_GRAPH_BS, model_runner.max_running_requests)


class CudaGraphRunner:
    def __init__(
        self, model_runner: "ModelRunner", backend: Backend, capture_lora: bool, capture: bool = True
    ) -> None:
        """`capture=False` allocates without capturing (see PrefillCudaGraphRunner)."""
        assert backend in (Backend.FULL, Backend.BREAKABLE)
        self.model_runner = model_runner
        self.backend = backend
        cfg = model_runner.server_args.cuda_graph_config.decode
        self.max_bs = decode_graph_max_bs(model_runner)
        self.buckets = sorted(set(cfg.bs)) if cfg.bs else decode_bucket_ladder(self.max_bs)
        self.enable_lora = model_runner.lora_manager is not None
        assert not capture_lora or self.enable_lora
        self.capture_lora = capture_lora
        if capture_lora:
            model_runner.lora_manager.init_cuda_graph_batch_info(self.max_bs, 1)
        self.buffers = GraphInputBuffers.allocate(
            self.max_bs, self.max_bs, model_runner.device, model_runner.padding_req_pool_index
        )
        if backend == Backend.FULL:
            model_runner.attn_backend.init_cuda_graph_state(self.max_bs, self.max_bs)
        self.seq_len_fill = model_runner.attn_backend.get_cuda_graph_seq_len_fill_value()
        self.hidden_out = torch.empty(
            (self.max_bs, model_runner.model_config.hidden_size),
            dtype=model_runner.dtype,
            device=model_runner.device,
        )
        self.graphs: dict[int, AnyGraph] = {}
        # The breakable graphs' break outputs, one buffer for every bucket (captured largest first).
        self.break_outputs = BreakOutputs()
        self.num_replays = 0
        if capture:
            self.capture()

    def refusal(self, fb: ForwardBatch) -> Optional[str]:
        """Why this batch cannot replay a decode graph (None: it can)."""
        if not fb.forward_mode.is_decode():
            return "not_decode"
        return "too_many_requests" if fb.batch_size > self.max_bs else None

    def can_run(self, fb: ForwardBatch) -> bool:
        return self.refusal(fb) is None

    def graph_plan(self) -> dict[str, Any]:
        """Everything `can_run` and the capture depend on (the same on every TP rank)."""
        return {"kind": "decode", "backend": self.backend.value, "capture_lora": self.capture_lora,
                "max_bs": self.max_bs, "buckets": list(self.buckets)}

    # ---------------------------------------------------------------------------- capture
    def capture(self) -> None:
        """Capture every bucket's graph (largest first). Every TP rank captures the same buckets
        in the same order: the all-reduces inside the body pair up across ranks."""
        mr = self.model_runner
        bar = tqdm(sorted(self.buckets, reverse=True), desc="Capturing decode CUDA graphs", unit="bs")
        for bs in bar:
            free_gib = torch.cuda.mem_get_info(mr.device)[0] / (1 << 30)
            bar.set_postfix_str(f"bs={bs} free={free_gib:.1f}GiB")
            self.graphs[bs] = self._capture_one(bs, mr.graph_capture_stream)
        torch.cuda.synchronize(mr.device)
        logger.info(
            "Captured %d decode CUDA graphs (%s, batch sizes %s..%s, LoRA %s).",
            len(self.buckets), self.backend.value, self.buckets[0], self.max_bs,
            "kernels captured" if self.capture_lora else ("set without LoRA" if self.enable_lora else "off"),
        )

    def _run_body(self, fb: ForwardBatch, bs: int) -> None:
        hidden = self.model_runner.model.model(fb.input_ids, fb.positions, fb)
        self.hidden_out[:bs].copy_(hidden)

    def _capture_one(self, bs: int, stream: torch.cuda.Stream) -> AnyGraph:
        mr = self.model_runner
        fb = self.buffers.capture_decode_batch(bs, self.seq_len_fill, with_lora=self.enable_lora)
        mr.attach_pools(fb)
        if self.backend == Backend.FULL:
            mr.attn_backend.init_forward_metadata_capture_cuda_graph(
                bs, bs, fb.req_pool_indices, fb.seq_lens, fb.forward_mode, fb
            )
        else:
            mr.attn_backend.init_forward_metadata(fb)
        if self.capture_lora:
            mr.lora_manager.prepare_lora_batch(fb, use_cuda_graph=True, use_prefill_cuda_graph=False)
        elif self.enable_lora:
            mr.lora_manager.prepare_lora_batch(fb, use_lora=False)  # base layers only
        return capture_graph(
            self.backend == Backend.BREAKABLE, lambda: self._run_body(fb, bs), fb, mr.graph_memory_pool, stream,
            self.break_outputs,
        )

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
