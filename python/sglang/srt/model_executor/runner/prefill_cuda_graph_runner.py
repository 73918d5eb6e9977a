"""Prefill CUDA graphs: the model body captured per token-count bucket (DESIGN §6).

Two backends:
  breakable  the body is a chain of segments broken at every attention call; attention runs eagerly
             with the live batch's metadata, so one graph captured with one request serves any batch
             whose tokens fit the bucket.
  full       the whole body, attention included, with a fixed number of request slots
             (`_capture_req_slots`); the attention metadata lives in static buffers too.

Only the body (`model.model`) is captured. The lm_head, logprobs and sampling run in the eager tail
on the live, unpadded batch.

LoRA servers hold two runners (two graph sets, one memory pool; ModelRunner picks one per forward):
  with LoRA kernels   (`capture_lora=True`) the static prefill `LoRABatchInfo` is initialised
                      before capture, capture runs with `lora_ids=[None] * bs` (every LoRA kernel
                      recorded, all idle at rank 0), and a batch replays only when
                      `LoRAManager.can_use_prefill_cuda_graph` holds — the same predicate that makes
                      `prepare_lora_batch` refresh the static info in place;
  without             (`capture_lora=False`) captured with the LoRA backend's `batch_info` None, so
                      the wrappers record the base layers only: it serves all-base batches at the
                      speed of a server without LoRA.
Buckets: the config's, else the default ladder up to `default_prefill_graph_cap` (serving-size
batches for the LoRA set), less any bucket no batch could fill (request slots x context length).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

import torch
from tqdm import tqdm

from sglang.srt.model_executor.cuda_graph_config import (
    Backend,
    default_prefill_graph_cap,
    fillable_buckets,
    prefill_bucket_ladder,
)
from sglang.srt.configs.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.runner.breakable_cuda_graph import BreakOutputs
from sglang.srt.model_executor.runner.graph_capture import AnyGraph, capture_graph
from sglang.srt.model_executor.runner.graph_buffers import GraphInputBuffers, prefill_replay_bucket
from sglang.srt.utils import cdiv

if TYPE_CHECKING:
    from sglang.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# Full backend: request slots captured per bucket, unless the config says otherwise.
DEFAULT_FULL_PREFILL_REQ_SLOTS = 16


class PrefillCudaGraphRunner:
    def __init__(
        self, model_runner: "ModelRunner", backend: Backend, capture_lora: bool, capture: bool = True
    ) -> None:
        """`capture=False` plans the buckets and allocates the buffers without capturing (the
        path decision can then be tested where no CUDA graph can run)."""
        assert backend in (Backend.BREAKABLE, Backend.FULL)
        self.model_runner = model_runner
        self.backend = backend
        server_args = model_runner.server_args
        cfg = server_args.cuda_graph_config.prefill
        lora_manager = model_runner.lora_manager
        self.enable_lora = lora_manager is not None
        # This runner records LoRA kernels only if the LoRA backend can serve them from static metadata.
        assert not capture_lora or (self.enable_lora and lora_manager.supports_prefill_cuda_graph)
        self.capture_lora = capture_lora
        # A capture request never exceeds the context length (its positions index the rotary table).
        self.max_req_tokens = model_runner.context_len

        if cfg.bs:
            wanted = sorted(set(cfg.bs))
        else:
            cap = cfg.max_bs or default_prefill_graph_cap(
                server_args.chunked_prefill_size, server_args.max_prefill_tokens, capture_lora
            )
            wanted = prefill_bucket_ladder(cap)
        if capture_lora:
            # Sized for the largest bucket wanted; the buckets it cannot serve are dropped below.
            lora_manager.init_prefill_cuda_graph_batch_info(wanted[-1])
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

        self.buffers = GraphInputBuffers.allocate(
            self.max_num_tokens, self._capture_req_slots, model_runner.device, model_runner.padding_req_pool_index
        )
        if backend == Backend.FULL:
            model_runner.attn_backend.init_cuda_graph_state(self._capture_req_slots, self.max_num_tokens)
        self.hidden_out = torch.empty(
            (self.max_num_tokens, model_runner.model_config.hidden_size),
            dtype=model_runner.dtype,
            device=model_runner.device,
        )
        self.graphs: dict[int, AnyGraph] = {}
        # The breakable graphs' break outputs, one buffer for every bucket (captured largest first).
        self.break_outputs = BreakOutputs()
        self.num_replays = 0
        if capture:
            self.capture()

    def graph_plan(self) -> dict[str, Any]:
        """Everything `can_run_graph` and the capture depend on (the same on every TP rank)."""
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

    def can_run_graph(self, fb: ForwardBatch) -> bool:
        return self.refusal(fb) is None

    # ---------------------------------------------------------------------------- capture
    def capture(self) -> None:
        """Capture every bucket's graph (largest first). Every TP rank captures the same buckets
        in the same order: the all-reduces inside the body pair up across ranks."""
        mr = self.model_runner
        stream = mr.graph_capture_stream
        bar = tqdm(
            sorted(self.buckets, reverse=True),  # largest first: smaller buckets reuse its memory
            desc=f"Capturing prefill CUDA graphs ({self.backend.value})",
            unit="bucket",
        )
        for n in bar:
            free_gib = torch.cuda.mem_get_info(mr.device)[0] / (1 << 30)
            bar.set_postfix_str(f"tokens={n} free={free_gib:.1f}GiB")
            self.graphs[n] = self._capture_one(n, stream)
        torch.cuda.synchronize(mr.device)
        logger.info(
            "Captured %d prefill CUDA graphs (%s, buckets %d..%d tokens, request slots %d, LoRA %s).",
            len(self.buckets),
            self.backend.value,
            self.buckets[0],
            self.max_num_tokens,
            self._capture_req_slots,
            "kernels captured" if self.capture_lora else ("set without LoRA" if self.enable_lora else "off"),
        )

    def _capture_batch(self, n: int) -> ForwardBatch:
        mr = self.model_runner
        reqs = self._capture_req_slots if self.backend == Backend.FULL else cdiv(n, self.max_req_tokens)
        fb = self.buffers.capture_extend_batch(n, reqs, self.enable_lora, self.max_req_tokens)
        mr.attach_pools(fb)
        if self.backend == Backend.FULL:
            mr.attn_backend.init_forward_metadata_capture_cuda_graph(
                fb.batch_size, n, fb.req_pool_indices, fb.seq_lens, fb.forward_mode, fb
            )
        else:
            mr.attn_backend.init_forward_metadata(fb)
        if self.capture_lora:
            # The capture batch takes the in-place path: ranks are all 0, kernels are recorded idle.
            assert mr.lora_manager.can_use_prefill_cuda_graph(fb)
            mr.lora_manager.prepare_lora_batch(fb, use_cuda_graph=False, use_prefill_cuda_graph=True)
        elif self.enable_lora:
            # The set without LoRA: `batch_info` None makes every wrapper run its base layer only.
            mr.lora_manager.prepare_lora_batch(fb, use_lora=False)
        return fb

    def _run_body(self, fb: ForwardBatch, n: int) -> None:
        hidden = self.model_runner.model.model(fb.input_ids, fb.positions, fb)
        self.hidden_out[:n].copy_(hidden)

    def _capture_one(self, n: int, stream: torch.cuda.Stream) -> AnyGraph:
        fb = self._capture_batch(n)
        return capture_graph(
            self.backend == Backend.BREAKABLE,
            lambda: self._run_body(fb, n),
            fb,
            self.model_runner.graph_memory_pool,
            stream,
            self.break_outputs,
        )

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
        if self.backend == Backend.BREAKABLE:
            mr.attn_backend.init_forward_metadata(static_fb)
            graph.replay(static_fb)
        else:
            mr.attn_backend.init_forward_metadata_replay_cuda_graph(
                fb.batch_size, fb.req_pool_indices, fb.seq_lens, fb.seq_lens_cpu, fb.forward_mode, static_fb
            )
            graph.replay()
        self.num_replays += 1
        return self.hidden_out[:n]

