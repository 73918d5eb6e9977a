"""Prefill CUDA graphs: the model body captured per token-count bucket (DESIGN §6).

Three backends:
  breakable     the body is a chain of segments broken at every attention call; attention runs
                eagerly with the live batch's metadata, so one graph captured with one request
                serves any batch whose tokens fit the bucket.
  full          the whole body, attention included, with a fixed number of request slots
                (`_capture_req_slots`); the attention metadata lives in static buffers too.
  tc_piecewise  breakable, with the segments compiled by torch.compile (piecewise_compile.py);
                base-model servers only.

Only the body (`model.model`) is captured. The lm_head, logprobs and sampling run in the eager tail
on the live, unpadded batch.

LoRA servers hold two runners (two graph sets, one memory pool; ModelRunner picks one per forward):
  with LoRA kernels   (`capture_lora=True`) the static prefill `LoRABatchInfo` is initialised
                      before capture, capture runs with `lora_ids=[None] * bs` (every LoRA kernel
                      recorded, all idle at rank 0), and a batch replays only when
                      `LoRAManager.can_use_prefill_cuda_graph` holds, so the manager's
                      `prepare_forward` refreshes the static info in place (PREFILL_GRAPH path);
  without             (`capture_lora=False`) captured with the LoRA backend's `batch_info` None, so
                      the wrappers record the base layers only: it serves all-base batches at the
                      speed of a server without LoRA.
Buckets: the config's, else the default ladder up to `default_prefill_graph_cap` (serving-size
batches for the LoRA set), less any bucket no batch could fill (request slots x context length).
What both graph runners share: graph_runner.py.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

import torch

from sglang.srt.configs.cuda_graph_config import (
    Backend,
    default_prefill_graph_cap,
    fillable_buckets,
    prefill_bucket_ladder,
)
from sglang.srt.configs.forward_batch_info import ForwardBatch
from sglang.srt.configs.forward_path import ForwardPath
from sglang.srt.model_executor.runner.graph_buffers import prefill_replay_bucket
from sglang.srt.model_executor.runner.graph_runner import GraphHost, GraphRunnerBase
from sglang.srt.model_executor.runner.piecewise_compile import compile_body
from sglang.srt.utils import cdiv

logger = logging.getLogger(__name__)

# Full backend: request slots captured per bucket, unless the config says otherwise.
DEFAULT_FULL_PREFILL_REQ_SLOTS = 16


class PrefillCudaGraphRunner(GraphRunnerBase):
    kind = "prefill"
    path = ForwardPath.PREFILL_GRAPH

    def __init__(
        self, model_runner: GraphHost, backend: Backend, capture_lora: bool, capture: bool = True,
        compile_mode: Optional[str] = None,
    ) -> None:
        """`capture=False` plans the buckets and allocates the buffers without capturing (the
        path decision can then be tested where no CUDA graph can run). `compile_mode`:
        tc_piecewise's, in place of the config's (benchmarks compare them)."""
        assert backend in (Backend.BREAKABLE, Backend.FULL, Backend.TC_PIECEWISE)
        assert backend != Backend.TC_PIECEWISE or not capture_lora, "tc_piecewise cannot follow LoRA metadata"
        super().__init__(model_runner, backend, capture_lora)
        config = model_runner.config
        cfg = config.cuda_graph.prefill
        if backend == Backend.TC_PIECEWISE:
            self.body = compile_body(model_runner.model, compile_mode or cfg.compile_mode)
        self.compile_s = 0.0
        lora_manager = model_runner.lora_manager
        # A capture request never exceeds the context length (its positions index the rotary table).
        self.max_req_tokens = model_runner.context_len

        if cfg.bs:
            wanted = sorted(set(cfg.bs))
        else:
            cap = cfg.max_bs or default_prefill_graph_cap(
                config.chunked_prefill_size, config.max_prefill_tokens, capture_lora
            )
            wanted = prefill_bucket_ladder(cap)
        if capture_lora:
            # Sized for the largest bucket wanted; the buckets it cannot serve are dropped below.
            lora_manager.init_prefill_cuda_graph_batch_info(wanted[-1], wanted)
        # Requests a replayed batch may have: the full graph's slots, and the LoRA metadata's cap.
        max_reqs = None
        if backend == Backend.FULL:
            max_reqs = min(cfg.full_prefill_max_req or DEFAULT_FULL_PREFILL_REQ_SLOTS,
                           model_runner.req_to_token_pool.size)
        if capture_lora:
            lora_cap = lora_manager.prefill_cuda_graph_max_bs
            max_reqs = lora_cap if max_reqs is None else min(max_reqs, lora_cap)
        self.buckets = fillable_buckets(wanted, max_reqs, self.max_req_tokens)
        if len(self.buckets) < len(wanted):
            logger.info(
                "Prefill graphs skip buckets %s: no batch of at most %s requests of at most %d tokens fills them.",
                wanted[len(self.buckets):], max_reqs, self.max_req_tokens,
            )
        if not self.buckets:
            raise ValueError(f"no prefill CUDA graph bucket is usable (wanted {wanted})")
        self.max_num_tokens = self.buckets[-1]
        # Full: the request axis is fixed at capture. Breakable: attention reads the live batch,
        # so a capture batch needs only as many requests as its tokens fill.
        if backend == Backend.FULL:
            self._capture_req_slots = max_reqs
        else:
            self._capture_req_slots = cdiv(self.max_num_tokens, self.max_req_tokens)

        self._allocate(self.max_num_tokens, self._capture_req_slots)
        if capture:
            self.capture()

    def graph_plan(self) -> dict[str, Any]:
        """Everything `can_run` and the capture depend on (the same on every TP rank)."""
        lora = self.model_runner.lora_manager if self.capture_lora else None
        return {
            "kind": "prefill", "backend": self.backend.value, "capture_lora": self.capture_lora,
            "buckets": list(self.buckets), "capture_req_slots": self._capture_req_slots,
            "lora_max_bs": lora.prefill_cuda_graph_max_bs if lora else None,
            "lora_max_tokens": lora.lora_backend.prefill_cuda_graph_max_tokens if lora else None,
        }

    # ---------------------------------------------------------------------------- eligibility
    def refusal(self, fb: ForwardBatch) -> Optional[str]:
        """Why this batch cannot replay a prefill graph (None: it can). Shapes only, plus, for the
        LoRA set, the LoRA predicate. Which set a batch goes to (LoRA or not) is
        ModelRunner.choose_forward_path's decision."""
        if not fb.forward_mode.is_extend() or fb.extend_num_tokens is None:
            return "not_extend"
        if prefill_replay_bucket(self.buckets, fb.extend_num_tokens) is None:
            return "too_many_tokens"
        if self.backend == Backend.FULL and fb.batch_size > self._capture_req_slots:
            return "too_many_requests"
        # The batch's metadata must be able to live in (and will be written into) the static
        # buffers the captured LoRA kernels read.
        if self.capture_lora and not self.model_runner.lora_manager.can_use_prefill_cuda_graph(fb):
            return "lora_not_eligible"
        return None

    # ---------------------------------------------------------------------------- capture
    def capture(self) -> None:
        if self.backend == Backend.TC_PIECEWISE:
            # Compile before the first capture, on the largest bucket (dynamic shapes: one
            # compilation for the others), so its cost is measured and logged on its own.
            start = time.perf_counter()
            with torch.cuda.stream(self.model_runner.graph_capture_stream):
                fb = self._capture_batch(self.buckets[-1])
                self._run_body(fb, self.buckets[-1])
            torch.cuda.synchronize(self.model_runner.device)
            self.compile_s = time.perf_counter() - start
            logger.info("tc_piecewise: torch.compile took %.1f s", self.compile_s)
        super().capture()

    def _capture_batch(self, n: int) -> ForwardBatch:
        reqs = self._capture_req_slots if self.backend == Backend.FULL else cdiv(n, self.max_req_tokens)
        fb = self.buffers.capture_extend_batch(n, reqs, self.enable_lora, self.max_req_tokens)
        # The capture batch takes the in-place path: ranks are all 0, kernels are recorded idle.
        assert not self.capture_lora or self.model_runner.lora_manager.can_use_prefill_cuda_graph(fb)
        return self._prepare_capture(fb, n)

    # ---------------------------------------------------------------------------- replay
    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """Run the body of the live batch `fb` through its bucket's graph; returns hidden [T, H]."""
        mr = self.model_runner
        n = fb.extend_num_tokens
        bucket = prefill_replay_bucket(self.buckets, n)
        self.buffers.load_tokens(fb, bucket)
        # The body sees bucket-sized token tensors but the live per-request metadata.
        static_fb = self.buffers.padded_view(fb, bucket)
        graph = self.graphs[bucket]
        if self.breakable:
            mr.attn_backend.init_forward_metadata(static_fb)
            graph.replay(static_fb)
        else:
            mr.attn_backend.init_forward_metadata_replay_cuda_graph(
                fb.batch_size, fb.req_pool_indices, fb.seq_lens, fb.seq_lens_cpu, fb.forward_mode, static_fb
            )
            graph.replay()
        self.num_replays += 1
        return self.hidden_out[:n]

