"""ModelRunner: owns the model, the KV pools, the attention backend, the LoRA manager, the graph
runners and the sampler, and runs one forward pass of a ForwardBatch.

`forward()` decides once which path serves the batch (decode graph, prefill graph or eager) and
whether LoRA kernels run (`ForwardPlan`, configs/forward_path.py), hands that same plan to the LoRA
manager (so static LoRA metadata is refreshed in place exactly when a graph will read it), runs the
body on that path, then the eager tail (logits, logprobs, sampling), which always runs outside
graphs.

A LoRA server captures two graph sets in one memory pool: one with the LoRA kernels, for batches
with an adapter, and one without, for all-base batches, which therefore run as on a server without
LoRA (eagerly too: the manager clears the LoRA batch info, and the wrappers skip their kernels).
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections import Counter
from concurrent.futures import Future, wait
from typing import Optional

import torch

from sglang.srt.configs.cuda_graph_config import Backend
from sglang.srt.configs.forward_batch_info import ForwardBatch
from sglang.srt.configs.forward_path import ForwardPath, ForwardPlan
from sglang.srt.configs.run_configs import RunnerConfig
from sglang.srt.configs.runner_output import ModelRunnerOutput
from sglang.srt.distributed import SINGLE_RANK, TensorParallelGroup
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.layers.sampler import Sampler, SamplerOutput
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator
from sglang.srt.lora.lora_manager import LoRAManager
from sglang.srt.model_executor.forward_clock import ForwardClock
from sglang.srt.model_executor.launched_forward import LaunchedForward
from sglang.srt.model_executor.model_loading import get_model
from sglang.srt.model_executor.runner.cuda_graph_runner import CudaGraphRunner
from sglang.srt.model_executor.runner.graph_sets import agree_on_graph_plans, plan_graph_sets
from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import PrefillCudaGraphRunner
from sglang.srt.utils import get_available_gpu_memory, get_available_host_memory, set_random_seed

logger = logging.getLogger(__name__)

CPU_DEFAULT_MAX_TOTAL_TOKENS = 16384
MAX_RUNNING_REQUESTS_CAP = 4096
# GPU memory kept out of the KV cache for activations, graphs and the allocator's slack, on top of
# the (1 - mem_fraction_static) share of the device that is never used for weights or KV.
ACTIVATION_RESERVE_GIB = 1.0
# req_to_token rows are context_len + this wide, so a row never needs a bounds check at its end.
REQ_TO_TOKEN_PAD = 8


def batch_needs_lora(fb: ForwardBatch) -> bool:
    """Whether any request of the batch uses an adapter (None ids are the base model)."""
    return fb.lora_ids is not None and any(lora_id is not None for lora_id in fb.lora_ids)


class ModelRunner:
    def __init__(self, config: RunnerConfig, gpu_id: int = 0, tp_group: TensorParallelGroup = SINGLE_RANK,
                 wait_for: Optional[Future] = None) -> None:
        """`wait_for`: start-up work running beside this constructor that holds the GIL (the
        scheduler's tokenizer load). It may overlap the weights; the startup adapter reads and the
        graph capture begin once it has ended."""
        assert config.split.tp_size == tp_group.size, "the config's split is for another group size"
        self.config = config
        self.gpu_id = gpu_id
        self.tp_group = tp_group
        self.device = torch.device(f"cuda:{gpu_id}" if config.device == "cuda" else config.device)
        self.clock = ForwardClock(os.environ.get("SGLANG_FORWARD_TIMES", "0") == "1", self.device)
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError("--device cuda: no CUDA device is available on this machine (use --device cpu)")
            torch.cuda.set_device(self.device)
            if config.deterministic:
                # Reduced-precision split-K reductions let a GEMM's result depend on its M (the
                # padded token count of a graph bucket vs the live count of an eager pass).
                torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
                torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        set_random_seed(config.random_seed)

        self.model_config = config.model
        self.dtype = self.model_config.dtype
        self.context_len = self.model_config.context_len
        free_before = get_available_gpu_memory(gpu_id) if self.device.type == "cuda" else None
        self.model = get_model(
            self.model_config,
            load_format=config.load_format,
            device=self.device,
            dtype=self.dtype,
            seed=config.random_seed,
            tp_group=tp_group,
        )
        # Under tensor parallelism each rank's KV pool holds its own KV heads only.
        self.num_kv_heads = config.split.num_kv_heads
        if free_before is not None:
            logger.info("Weights use %.2f GiB", free_before - get_available_gpu_memory(gpu_id))
        self.sampler = Sampler()
        if wait_for is not None:
            # The adapter reads and the capture are torch ops and CUDA calls, each giving up the GIL
            # and waiting to win it back from a thread that holds it (H200: a LoRA server's 102
            # graphs took 40.3 s beside the tokenizer's load, 19.6 s after it; 64 adapter reads 15.1 s
            # beside it, 4.7 s alone in bench_adapter_reads).
            waited = time.perf_counter()
            wait([wait_for])
            logger.info("Start-up work beside the model runner waited for after the weights: %.1f s",
                        time.perf_counter() - waited)
        self.lora_manager = None
        if config.lora is not None:
            # After the weights (it wraps the loaded layers), before memory sizing (its pool
            # takes device memory). Startup ids are the main process's registry's (config.refs).
            self.lora_manager = LoRAManager(self.model, self.model_config, config.lora, self.device, self.dtype,
                                            tp_group)
        # The startup adapters are committed here, before the KV cache and graphs, unless their reads
        # were asked to overlap them (SGLANG_LORA_STARTUP_OVERLAP=1: committed after the graphs).
        if self.lora_manager is not None and not self.lora_manager.startup_overlap:
            self.lora_manager.finish_startup()
        self.init_memory_pool()
        self.attn_backend = self._create_attn_backend()
        # The graph set with LoRA kernels on a LoRA server (the only set without LoRA), and the set
        # without them that serves a LoRA server's all-base batches.
        self.prefill_graph_runner = None
        self.decode_graph_runner = None
        self.base_prefill_graph_runner = None
        self.base_decode_graph_runner = None
        self.graph_capture_s = 0.0
        self.num_eager_prefills = 0
        self.num_eager_decodes = 0
        # Forward batches by (mode, path, reason it ran eagerly): what /metrics exports.
        self.forward_paths: Counter[tuple[str, str, str]] = Counter()
        self.init_cuda_graphs()
        if self.lora_manager is not None and self.lora_manager.startup_overlap:
            self.lora_manager.finish_startup()

    # ------------------------------------------------------------------ setup
    def _kv_bytes_per_token(self) -> int:
        c = self.model_config
        return MHATokenToKVPool.bytes_per_token(self.dtype, self.num_kv_heads, c.head_dim, c.num_hidden_layers)

    def profile_max_num_tokens(self) -> int:
        """KV capacity on CUDA: `mem_fraction_static` of the device for weights + KV (the weights
        are already loaded), less a reserve for activations and graphs."""
        total = torch.cuda.mem_get_info(self.device)[1] / (1 << 30)
        free = get_available_gpu_memory(self.gpu_id)
        kv_gib = free - total * (1.0 - self.config.mem_fraction_static) - ACTIVATION_RESERVE_GIB
        tokens = int(kv_gib * (1 << 30) // self._kv_bytes_per_token())
        if tokens <= 0:
            raise ValueError(
                f"no GPU memory left for the KV cache ({free:.1f} GiB free of {total:.1f} GiB after "
                f"loading the weights); raise --mem-fraction-static or use a smaller model/dtype"
            )
        return tokens

    def _default_max_running_requests(self, tokens: int) -> int:
        return self.config.max_running_requests or max(1, min(MAX_RUNNING_REQUESTS_CAP, tokens // 2))

    def _request_table_bytes(self, rows: int) -> int:
        """ReqToTokenPool's int32 table of `rows` requests."""
        return rows * (self.context_len + REQ_TO_TOKEN_PAD) * 4

    def _check_host_memory(self, tokens: int) -> None:
        """On the CPU the pools come out of host memory: a size that cannot fit is the user's
        flag, named, not the allocator's traceback (or the machine swapping to death)."""
        available = get_available_host_memory()
        if available is None:
            return
        rows = self._default_max_running_requests(tokens) + 1
        kv = tokens * self._kv_bytes_per_token()
        table = self._request_table_bytes(rows)
        gib = 1 << 30
        if kv + table > available:
            raise ValueError(
                f"the KV cache of --max-total-tokens {tokens} ({kv / gib:.1f} GiB) and the request table of "
                f"{rows - 1} running requests (--max-running-requests; {table / gib:.1f} GiB) do not fit in "
                f"the {available / gib:.1f} GiB of memory available; lower them"
            )

    def init_memory_pool(self) -> None:
        args = self.config
        if self.device.type == "cuda":
            budget = self.profile_max_num_tokens()
            # The request table comes out of the same budget as the KV cache.
            rows = self._default_max_running_requests(args.max_total_tokens or budget) + 1
            table_bytes = self._request_table_bytes(rows)
            budget -= -(-table_bytes // self._kv_bytes_per_token())
            if budget <= 0:
                raise ValueError("no GPU memory left for the KV cache; lower --max-running-requests")
            if args.max_total_tokens is not None and args.max_total_tokens > budget:
                logger.warning(
                    "--max-total-tokens %d exceeds the %d tokens that fit; using %d.",
                    args.max_total_tokens, budget, budget,
                )
            tokens = min(args.max_total_tokens or budget, budget)
        else:
            tokens = args.max_total_tokens or CPU_DEFAULT_MAX_TOTAL_TOKENS
            self._check_host_memory(tokens)
        # Every TP rank must admit the same requests: all take the smallest rank's capacity.
        self.max_total_num_tokens = self.tp_group.min_over_ranks(int(tokens))
        self.max_running_requests = self._default_max_running_requests(self.max_total_num_tokens)
        c = self.model_config
        # One extra row, reserved below as the padding row of graph replays: it maps every
        # position to the dummy KV slot 0, so padded requests read and write nothing real.
        self.req_to_token_pool = ReqToTokenPool(
            self.max_running_requests + 1, self.context_len + REQ_TO_TOKEN_PAD, self.device
        )
        (self.padding_req_pool_index,) = self.req_to_token_pool.alloc(1)
        self.token_to_kv_pool = MHATokenToKVPool(
            self.max_total_num_tokens,
            self.dtype,
            self.num_kv_heads,
            c.head_dim,
            c.num_hidden_layers,
            self.device,
        )
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(self.max_total_num_tokens)
        kv_gib = self.max_total_num_tokens * self._kv_bytes_per_token() / (1 << 30)
        logger.info(
            "KV cache: %d tokens (%.2f GiB, %s), max running requests %d, context length %d",
            self.max_total_num_tokens, kv_gib, str(self.dtype).replace("torch.", ""),
            self.max_running_requests, self.context_len,
        )
        if self.max_total_num_tokens < self.context_len:
            logger.warning(
                "The KV cache holds %d tokens, fewer than the context length (%d): a request's prompt and "
                "output together are limited to %d tokens.",
                self.max_total_num_tokens, self.context_len, self.max_total_num_tokens,
            )

    def _create_attn_backend(self):
        name = self.config.attention_backend
        if name == "torch_native":
            from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

            return TorchNativeAttnBackend(self)
        if name == "triton":
            from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

            return TritonAttnBackend(self)
        raise ValueError(f"unknown attention backend {name!r}")

    def _graph_backends(self) -> tuple[Backend, Backend]:
        """The (prefill, decode) graph backends this runner can actually serve, with the reason
        logged for each one it turns off."""
        cfg = self.config.cuda_graph
        prefill, decode = cfg.prefill.backend, cfg.decode.backend
        if self.device.type != "cuda":
            if prefill != Backend.DISABLED or decode != Backend.DISABLED:
                logger.info("CUDA graphs need a CUDA device; running eagerly on %s.", self.device)
            return Backend.DISABLED, Backend.DISABLED
        lora = self.lora_manager
        if prefill == Backend.TC_PIECEWISE and lora is not None:
            # The flag's rule turns it off under LoRA unless it was asked for explicitly: the
            # compiled body cannot follow per-batch LoRA metadata, the breakable graph can.
            logger.warning("tc_piecewise prefill graphs cannot carry LoRA; using the breakable graph.")
            prefill = Backend.BREAKABLE
        if lora is not None and not lora.supports_prefill_cuda_graph and (
            prefill != Backend.DISABLED or decode != Backend.DISABLED
        ):
            logger.warning(
                "Batches with LoRA adapters run eagerly: LoRA backend %r keeps its metadata on the "
                "host. All-base batches keep the CUDA graphs.", lora.lora_backend.name,
            )
        if self.config.attention_backend == "torch_native":
            # The reference backend has no static-metadata hooks; the breakable graph runs
            # attention eagerly and needs none.
            if prefill == Backend.FULL or decode == Backend.FULL:
                logger.warning("torch_native attention cannot be captured whole; using breakable graphs.")
            prefill = Backend.BREAKABLE if prefill == Backend.FULL else prefill
            decode = Backend.BREAKABLE if decode == Backend.FULL else decode
        return prefill, decode

    def init_cuda_graphs(self) -> None:
        """Capture the prefill graphs first, then the decode graphs (both read LoRA metadata that
        must exist before capture)."""
        prefill, decode = self._graph_backends()
        if prefill == Backend.DISABLED and decode == Backend.DISABLED:
            return
        # Both graph sets share one pool: replays never overlap, so each capture may reuse the
        # memory every earlier capture has freed.
        self.graph_memory_pool = torch.cuda.graph_pool_handle()
        self.graph_capture_stream = torch.cuda.Stream(self.device)
        free_before = get_available_gpu_memory(self.gpu_id)
        start = time.perf_counter()
        lora_kernels = self.lora_manager is not None and self.lora_manager.supports_prefill_cuda_graph
        # Every capture collects garbage first (capture_graph, torch.cuda.graph). A server holds
        # ~10^5 live objects and a full collection takes 0.1-0.6 s: over ~100 graphs that is most
        # of the capture time. Frozen, those objects are skipped; only what capture made is scanned.
        gc.collect()
        gc.freeze()
        try:
            self._capture_graph_sets(prefill, decode, lora_kernels)
        finally:
            gc.unfreeze()
        self.graph_capture_s = time.perf_counter() - start
        logger.info(
            "CUDA graphs: %d captured in %.1f s, using %.2f GiB", self._num_graphs(), self.graph_capture_s,
            free_before - get_available_gpu_memory(self.gpu_id),
        )

    def _capture_graph_sets(self, prefill: Backend, decode: Backend, lora_kernels: bool) -> None:
        with torch.no_grad():
            runners = plan_graph_sets(self, prefill, decode, lora_kernels)
            agree_on_graph_plans(self.tp_group, runners)  # before any capture: TP ranks pair up
            for runner in runners:
                runner.capture()

    def _graph_runners(
        self, lora: bool
    ) -> tuple[Optional[PrefillCudaGraphRunner], Optional[CudaGraphRunner]]:
        """(prefill, decode) runners of the graph set for batches with (or without) LoRA work."""
        if self.lora_manager is None or lora:
            return self.prefill_graph_runner, self.decode_graph_runner
        return self.base_prefill_graph_runner, self.base_decode_graph_runner

    def _num_graphs(self) -> int:
        runners = (self.prefill_graph_runner, self.decode_graph_runner,
                   self.base_prefill_graph_runner, self.base_decode_graph_runner)
        return sum(len(r.graphs) for r in runners if r is not None)

    def graph_stats(self) -> dict[str, float]:
        """Replay and eager-fallback counters (reported by /get_server_info). Replays count both
        graph sets; the `base_` counters are the all-base batches of a LoRA server."""
        def replays(*runners) -> int:
            return sum(r.num_replays for r in runners if r is not None)

        lora = self.lora_manager.lora_backend if self.lora_manager is not None else None
        return {
            # LoRA metadata refreshes of graph batches, and those that wrote (the batch had changed).
            "lora_metadata_refreshes": lora.metadata_refreshes if lora is not None else 0,
            "lora_metadata_writes": lora.metadata_writes if lora is not None else 0,
            "prefill_graph_replays": replays(self.prefill_graph_runner, self.base_prefill_graph_runner),
            "decode_graph_replays": replays(self.decode_graph_runner, self.base_decode_graph_runner),
            "base_prefill_graph_replays": replays(self.base_prefill_graph_runner),
            "base_decode_graph_replays": replays(self.base_decode_graph_runner),
            "eager_prefills": self.num_eager_prefills,
            "eager_decodes": self.num_eager_decodes,
            "num_graphs": self._num_graphs(),
            "capture_seconds": round(self.graph_capture_s, 2),
            # [mode, path, reason, batches]: reason says why a batch ran eagerly ("" for graphs).
            "forward_paths": [[*key, n] for key, n in sorted(self.forward_paths.items())],
        }

    # ------------------------------------------------------------------ forward
    def attach_pools(self, fb: ForwardBatch) -> None:
        fb.req_to_token_pool = self.req_to_token_pool
        fb.token_to_kv_pool = self.token_to_kv_pool
        fb.attn_backend = self.attn_backend

    def choose_forward_path(self, fb: ForwardBatch) -> ForwardPlan:
        """Which path serves this batch, and whether LoRA kernels run. The single decision point:
        LoRA preparation and the body both follow it (a graph with LoRA kernels is only replayed
        if its LoRA metadata is refreshed in place; a batch without adapters takes the graph set
        without LoRA kernels, or runs eagerly with the LoRA wrappers off)."""
        lora = batch_needs_lora(fb)
        prefill_runner, decode_runner = self._graph_runners(lora)
        mode = fb.forward_mode
        if mode.is_decode():
            reason = "graphs_disabled" if decode_runner is None else decode_runner.refusal(fb)
            if reason is None:
                self.forward_paths["decode", "decode_graph", ""] += 1
                return ForwardPlan(ForwardPath.DECODE_GRAPH, lora)
            self.num_eager_decodes += 1
            self.forward_paths["decode", "eager", reason] += 1
        elif mode.is_extend():
            reason = "graphs_disabled" if prefill_runner is None else prefill_runner.refusal(fb)
            if reason is None:
                self.forward_paths["prefill", f"{prefill_runner.backend.value}_prefill_graph", ""] += 1
                return ForwardPlan(ForwardPath.PREFILL_GRAPH, lora)
            self.num_eager_prefills += 1
            self.forward_paths["prefill", "eager", reason] += 1
        return ForwardPlan(ForwardPath.EAGER, lora)

    def run_body(self, fb: ForwardBatch, plan: ForwardPlan) -> torch.Tensor:
        """The model body on the chosen path -> hidden [T', H] (T' >= live tokens when padded)."""
        prefill_runner, decode_runner = self._graph_runners(plan.lora)
        if plan.path is ForwardPath.DECODE_GRAPH:
            return decode_runner.replay(fb)
        if plan.path is ForwardPath.PREFILL_GRAPH:
            return prefill_runner.replay(fb)
        assert plan.path is ForwardPath.EAGER, f"no runner for forward path {plan.path!r}"
        self.attn_backend.init_forward_metadata(fb)
        return self.model.model(fb.input_ids, fb.positions, fb)

    def prepare(self, fb: ForwardBatch) -> ForwardPlan:
        """Attach the pools, decide the path once, and prepare LoRA for that same decision."""
        self.attach_pools(fb)
        plan = self.choose_forward_path(fb)
        if self.lora_manager is not None:
            self.lora_manager.prepare_forward(fb, plan)
        return plan

    @torch.no_grad()
    def forward(self, fb: ForwardBatch) -> ModelRunnerOutput:
        start = self.clock.mark()
        plan = self.prepare(fb)
        hidden = self.run_body(fb, plan)
        out = self.run_eager_tail(fb, hidden, used_cuda_graph=plan.path.is_graph)
        self.clock.add(fb, start, self.clock.mark())
        return out

    @torch.no_grad()
    def launch_forward(self, fb: ForwardBatch) -> LaunchedForward:
        """`forward` without waiting: everything is queued, the sampled tokens stay on the device
        (and are being copied to the host); `finish_forward` returns what `forward` would have (a
        prefill's prompt logprobs are copied there, after its sample)."""
        start = self.clock.mark()
        plan = self.prepare(fb)
        hidden = self.run_body(fb, plan)
        logits_out = self.compute_logits(fb, hidden)
        sample = self._sample(fb, logits_out)
        launched = LaunchedForward.start(fb, logits_out, sample, plan.path.is_graph)
        launched.timed = (start, self.clock.mark())
        return launched

    def finish_forward(self, launched: LaunchedForward) -> ModelRunnerOutput:
        out = self._to_host(launched.fb, launched.logits_out, launched.wait(), launched.used_cuda_graph)
        self.clock.add(launched.fb, *launched.timed)
        return out

    @staticmethod
    def _live_tokens(fb: ForwardBatch) -> int:
        return fb.extend_num_tokens if fb.forward_mode.is_extend() else fb.batch_size

    def compute_logits(self, fb: ForwardBatch, hidden: torch.Tensor) -> LogitsProcessorOutput:
        # Rows past the live tokens (padding of a graph replay) are dropped here.
        hidden = hidden[: self._live_tokens(fb)]
        return self.model.logits_processor(fb.input_ids, hidden, self.model.lm_head, fb)

    def run_eager_tail(self, fb: ForwardBatch, hidden: torch.Tensor, used_cuda_graph: bool) -> ModelRunnerOutput:
        logits_out = self.compute_logits(fb, hidden)
        return self._to_host(fb, logits_out, self._sample(fb, logits_out), used_cuda_graph)

    def _sample(self, fb: ForwardBatch, logits_out: LogitsProcessorOutput) -> SamplerOutput:
        sample = self.sampler(
            logits_out.next_token_logits,
            fb.sampling_info,
            return_logprob=fb.return_logprob,
            top_logprobs_nums=fb.top_logprobs_nums,
        )
        # Every rank holds the same gathered logits, but a sampled row draws noise from the rank's
        # own generator: rank 0's choice is everyone's, or the ranks' stop decisions (and with
        # them the collectives they run) would drift apart.
        self.tp_group.broadcast(sample.next_token_ids, src=0)
        return sample

    @staticmethod
    def _to_host(
        fb: ForwardBatch, logits_out: LogitsProcessorOutput, sample: SamplerOutput, used_cuda_graph: bool
    ) -> ModelRunnerOutput:
        # The one device->host sync of a forward; the list conversions after it find data ready.
        out = ModelRunnerOutput(next_token_ids=sample.next_token_ids.cpu(), used_cuda_graph=used_cuda_graph)
        if not fb.return_logprob:
            return out
        out.next_token_logprobs = sample.logprobs.tolist()
        nums = fb.top_logprobs_nums or [0] * fb.batch_size
        if sample.top_logprobs_val is not None:
            vals, idx = sample.top_logprobs_val.tolist(), sample.top_logprobs_idx.tolist()
            out.next_token_top_logprobs = [
                (vals[i][:k], idx[i][:k]) if k > 0 else None for i, k in enumerate(nums)
            ]
        else:
            out.next_token_top_logprobs = [None] * fb.batch_size
        out.input_token_logprobs, out.input_top_logprobs = logits_out.input_logprobs_lists()
        return out

    @torch.no_grad()
    def forward_logits(self, fb: ForwardBatch) -> LogitsProcessorOutput:
        """Body + logits, no sampling: for tests and tools."""
        plan = self.prepare(fb)
        return self.compute_logits(fb, self.run_body(fb, plan))
