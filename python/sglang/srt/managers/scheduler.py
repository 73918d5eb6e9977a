"""The scheduler: a loop in the child process that owns the ModelRunner (DESIGN §3 steps 2-5).

Each turn (`event_loop`): take every pending message, then run one batch, prefill first (FCFS,
chunked, within the KV / row / token / LoRA budgets of schedule_policy.py), else one decode step of
every running request (scheduler_admission.py). When decode finds no free KV slot it *retracts*
the newest running requests back to the queue (they give their KV back and are prefilled again
later, resuming where they stopped). The forward's results: scheduler_output_processor.py.
With the prefix cache (managers/prefix_cache.py, on unless --disable-radix-cache), admission
reuses cached prefixes, every prefill pass and every finished or retracted request leaves its KV
in the cache, and cached KV is evicted (least recently used first) before anything is retracted.
A forward that raises fails only the requests of its batch; the loop keeps serving. Under tensor
parallelism it is fatal instead (`RankFailure`): the other ranks may already wait in a collective
this rank will never join, so the rank exits and the parent brings the server down naming it.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from typing import TYPE_CHECKING, Any, Callable, Optional

from sglang.srt.configs.forward_batch_info import ForwardMode
from sglang.srt.configs.run_configs import SchedulerConfig
from sglang.srt.configs.tokenizer import start_tokenizer_load
from sglang.srt.distributed import SINGLE_RANK, TensorParallelGroup
from sglang.srt.managers.integrity import IntegrityLog
from sglang.srt.managers.io_struct import (
    AbortReq,
    FaultInjectionReq,
    FlushCacheOut,
    FlushCacheReq,
    GetServerInfoOut,
    GetServerInfoReq,
    LoadLoRAAdapterReq,
    ShutdownReq,
    TokenizedBatchReqInput,
    TokenizedGenerateReqInput,
    UnloadLoRAAdapterReq,
)
from sglang.srt.managers.prefix_cache import PrefixCache
from sglang.srt.managers.req import Req
from sglang.srt.managers.schedule_batch import LogitContext, ScheduleBatch, release_kv
from sglang.srt.managers.schedule_policy import GroupedLoRAAdmission
from sglang.srt.managers.scheduler_admission import INIT_NEW_TOKEN_RATIO, SchedulerAdmissionMixin
from sglang.srt.managers.scheduler_grammar import GRAMMAR_POLL_S, GrammarReady, SchedulerGrammarMixin
from sglang.srt.managers.scheduler_input import receive_messages
from sglang.srt.managers.scheduler_integrity import SchedulerIntegrityMixin
from sglang.srt.managers.scheduler_lora import SchedulerLoRAMixin
from sglang.srt.managers.scheduler_output import StopChecker, build_output
from sglang.srt.managers.scheduler_output_processor import SchedulerOutputMixin
from sglang.srt.managers.scheduler_overlap import SchedulerOverlapMixin
from sglang.srt.model_executor.model_runner import ModelRunner

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

IDLE_POLL_S = 1.0


class RankFailure(RuntimeError):
    """A batch failed on this tensor-parallel rank: the rank stops (see the module doc)."""


class Scheduler(SchedulerAdmissionMixin, SchedulerOutputMixin, SchedulerLoRAMixin, SchedulerIntegrityMixin,
                SchedulerOverlapMixin, SchedulerGrammarMixin):
    """The loop, the message dispatch and the request lifecycle live here; admission and
    retraction (scheduler_admission.py), what a forward's results do (scheduler_output_processor.py),
    LoRA residency and commands (scheduler_lora.py), the integrity check (scheduler_integrity.py),
    the overlap schedule (scheduler_overlap.py) and constrained decoding (scheduler_grammar.py) are
    mixins over the same state."""

    def __init__(
        self,
        config: SchedulerConfig,
        recv_conn: Any,
        send_conn: Any,
        tp_group: TensorParallelGroup = SINGLE_RANK,
        gpu_id: int = 0,
    ) -> None:
        self.config = config
        # Under tensor parallelism only rank 0 has pipes: it receives and broadcasts, and replies.
        self.recv_conn = recv_conn
        self.send_conn = send_conn
        self.tp_group = tp_group
        # The tokenizer (for stop strings) loads while the weights load; the adapter reads and the
        # graph capture come after it (its import holds the GIL, which they need).
        tokenizer_load = start_tokenizer_load(config.tokenizer)
        self.model_runner = ModelRunner(config.runner, gpu_id=gpu_id, tp_group=tp_group, wait_for=tokenizer_load)
        mr = self.model_runner
        self.allocator = mr.token_to_kv_pool_allocator
        self.req_to_token_pool = mr.req_to_token_pool
        self.max_total_num_tokens = mr.max_total_num_tokens
        self.max_running_requests = min(config.runner.max_running_requests or mr.max_running_requests,
                                        mr.max_running_requests)
        # Rows the pool can give to requests (the model runner may keep one as a padding row).
        self.total_rows = self.req_to_token_pool.available_size()
        tokenizer = tokenizer_load.result() if tokenizer_load is not None else None
        eos = set(mr.model_config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.stop_checker = StopChecker(eos, tokenizer, mr.context_len)
        self.logit_ctx = LogitContext(eos, mr.model_config.vocab_size, mr.device)
        lm = mr.lora_manager
        self.lora_admission = GroupedLoRAAdmission(lm.validate_lora_batch if lm is not None else None,
                                                   config.lora_max_wait_turns,
                                                   lm.needs_slot if lm is not None else None)
        self.prefix_cache: Optional[PrefixCache] = None if config.disable_radix_cache else PrefixCache(mr)
        # --schedule-policy lpm ranks by cached prefix; without a cache there is nothing to rank.
        self.longest_prefix_first = config.schedule_policy == "lpm" and self.prefix_cache is not None
        if config.schedule_policy == "lpm" and self.prefix_cache is None:
            logger.info("--schedule-policy lpm with --disable-radix-cache: no prefix to rank, admitting FCFS")

        self.waiting: list[Req] = []  # FCFS by arrival
        self.init_grammar(tokenizer, eos)  # constrained requests wait in grammar_queue for their compile
        self.running: list[Req] = []
        self.chunked_req: Optional[Req] = None
        self.rid_to_req: dict[str, Req] = {}
        self.arrivals = 0
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.faults: list[FaultInjectionReq] = []
        # Counters for /get_server_info. decode_reqs / decode_steps is the mean running batch (a
        # benchmark reads the change over its run).
        self.stats = {"num_retractions": 0, "num_forward_failures": 0, "num_finished": 0, "decode_steps": 0,
                      "decode_reqs": 0, "prefill_batches": 0, "prefill_tokens": 0,
                      # decode steps launched before the previous step's tokens reached the host, and
                      # prefills queued behind a step in flight (the overlap schedule)
                      "overlapped_decode_steps": 0, "overlapped_prefills": 0,
                      # tokens such steps computed for requests that had stopped (EOS, a stop string, an abort)
                      "overlap_discarded_tokens": 0,
                      # requests refused with a 503 because --max-queued-requests were waiting
                      "num_rejected_queue_full": 0}
        self.max_queued_requests = config.max_queued_requests
        self.decode_tokens_since_log = 0
        self.last_decode_log = time.monotonic()
        self.last_gen_throughput = 0.0
        self.last_integrity_check: dict[str, Any] = {}
        self.integrity_log = IntegrityLog(logger, "Scheduler")
        self.was_idle = True
        self.heartbeat = time.monotonic()  # the start of the current event-loop turn
        self.overlap = config.overlap_schedule and tp_group.size == 1
        if config.overlap_schedule and not self.overlap:
            logger.warning("--enable-overlap-schedule: not under tensor parallelism; decoding step by step")
        self.inflight = None
        # A prefill admitted while a decode step is in flight is queued behind it (scheduler_overlap.py;
        # on the H200 +9% requests/s and -26% mean TTFT on a base server). SGLANG_OVERLAP_PREFILL=0
        # finishes the step first instead.
        self.overlap_prefill = os.environ.get("SGLANG_OVERLAP_PREFILL", "1") != "0"
        self.check_integrity()

    # ------------------------------------------------------------------ loop
    def event_loop(self) -> None:
        stalled = False
        while True:
            # A turn ends within IDLE_POLL_S when idle (every rank's message poll returns): a
            # heartbeat this old means a turn is stuck (scheduler_process._watch_progress).
            self.heartbeat = time.monotonic()
            idle = self.is_idle()
            if idle and not self.was_idle:
                self.check_integrity()
                self.last_decode_log = time.monotonic()
                self.decode_tokens_since_log = 0
            self.was_idle = idle
            if not self.process_messages(block=idle or stalled):
                return
            # Nothing runnable (e.g. every waiting request waits for an adapter slot): only a
            # message can change that, so wait for one instead of spinning.
            stalled = not self.schedule_turn()

    def is_idle(self) -> bool:
        """Nothing runs, waits or is in flight."""
        return not (self.waiting or self.running or self.chunked_req or self.inflight or self.grammar_queue)

    def schedule_turn(self) -> bool:
        """Run the next batch (overlapped: launch the next decode step and finish the one in
        flight); False when nothing was runnable."""
        if self.overlap:
            return self.overlap_turn()
        batch = self.get_next_batch()
        if batch is None:
            return False
        self.run_batch(*batch)
        return True

    # ------------------------------------------------------------------ messages
    def send(self, msg: Any) -> None:
        if self.send_conn is not None:
            self.send_conn.send(msg)

    def process_messages(self, block: bool) -> bool:
        """Handle every pending message (the same on every TP rank); False once asked to shut down."""
        timeout = (GRAMMAR_POLL_S if self.grammar_queue else IDLE_POLL_S) if block else 0.0
        # Rank 0's own news goes first, broadcast with the pipe's messages: compiles it saw finish.
        local = []
        if self.grammar_queue and self.tp_group.is_first_rank:
            ready = self.ready_grammar_rids()
            if ready:
                local.append(GrammarReady(ready))
        for msg in receive_messages(self.recv_conn, self.tp_group, timeout, local):
            if self.inflight is not None and not isinstance(msg, (TokenizedGenerateReqInput, TokenizedBatchReqInput, AbortReq,
                                                                   GetServerInfoReq, GrammarReady)):
                self.drain_inflight()  # adapter loads, flushes, faults, shutdown: with no step in flight
            if isinstance(msg, TokenizedGenerateReqInput):
                self.add_request(msg)
            elif isinstance(msg, TokenizedBatchReqInput):
                for req in msg.reqs:
                    self.add_request(req)
            elif isinstance(msg, GrammarReady):
                self.on_grammar_ready(msg)
            elif isinstance(msg, AbortReq):
                self.abort_request(msg.rid)
            elif isinstance(msg, GetServerInfoReq):
                # Requests may have come and gone within these messages (an arrival refused, or
                # aborted at once) without a turn of their own: the reported check then described
                # the pools before them, beside live counters of after.
                self._recheck_if_idle()
                self.send(GetServerInfoOut(info=self.live_info()))
            elif isinstance(msg, FaultInjectionReq):
                # A fault may target one TP rank only: the case of a failure the others never see.
                if self.config.enable_test_hooks and msg.tp_rank in (None, self.tp_group.rank):
                    self.faults.append(msg)
            elif isinstance(msg, (LoadLoRAAdapterReq, UnloadLoRAAdapterReq)):
                self.send(self.update_lora(msg))
            elif isinstance(msg, FlushCacheReq):
                self.send(self.flush_cache())
            elif isinstance(msg, ShutdownReq):
                return False
            else:
                logger.warning("unknown message %r", type(msg).__name__)
        return True

    def add_request(self, msg: TokenizedGenerateReqInput) -> None:
        if msg.rid in self.rid_to_req:
            logger.warning("duplicate request id %r ignored", msg.rid)
            return
        req = Req(msg, self.arrivals)
        self.arrivals += 1
        self.rid_to_req[req.rid] = req
        queued = len(self.waiting) + len(self.grammar_queue)
        if self.max_queued_requests is not None and queued >= self.max_queued_requests:
            # Refused before it holds anything; 503, so that a client or load balancer retries
            # (elsewhere, or later) instead of waiting behind a queue that only grows.
            self.stats["num_rejected_queue_full"] += 1
            self.finish(req, {"type": "abort", "status_code": 503,
                              "message": f"the request queue is full ({queued} requests wait to run, "
                                         f"--max-queued-requests {self.max_queued_requests}); retry later"})
            return
        self.queue_request(req)

    def abort_request(self, rid: str) -> None:
        req = self.rid_to_req.get(rid)
        if req is None:
            return  # already finished
        if req in self.waiting:
            self.waiting.remove(req)
        # Tell the tokenizer manager: after /abort_request a caller may still be waiting (after a
        # disconnect nobody is, and the news is dropped there).
        self.finish(req, {"type": "abort", "message": "the request was aborted"})

    def flush_cache(self) -> FlushCacheOut:
        busy = len(self.running) + len(self.waiting) + len(self.grammar_queue) + (self.chunked_req is not None)
        if busy:
            return FlushCacheOut(False, f"Cannot flush the cache while {busy} request(s) are running or "
                                        "waiting; try again when the server is idle.")
        if self.prefix_cache is None:
            return FlushCacheOut(True, "The prefix cache is disabled (--disable-radix-cache); nothing to flush.")
        freed = self.prefix_cache.flush()
        logger.info("Cache flushed: %d cached tokens freed.", freed)
        self._recheck_if_idle()
        return FlushCacheOut(True, f"Cache flushed: {freed} cached tokens freed.")

    # ------------------------------------------------------------------ request lifecycle
    def _release(self, req: Req, insert: bool) -> None:
        """Give back the request's KV and row; with the cache, what it computed is cached first
        when `insert` (a normal finish or a retraction, never an abort: its KV may be unwritten)."""
        if self.prefix_cache is not None:
            self.prefix_cache.release(req, insert)
        else:
            release_kv(req, self.model_runner)

    def finish(self, req: Req, reason: dict[str, Any], notify: bool = True) -> None:
        req.finished_reason = reason
        if req.decode_ahead and req.req_pool_idx is not None:
            # (overlap schedule) the slot of a step in flight past the request's last token: given
            # back first, so what is cached and freed is what the ordinary schedule would leave.
            kv_len = req.kv_len
            self.allocator.free(self.req_to_token_pool.slots([req.req_pool_idx], kv_len, kv_len - req.decode_ahead)[0])
            req.kv_len -= req.decode_ahead
            self.stats["overlap_discarded_tokens"] += req.decode_ahead
        req.decode_ahead = 0
        if req in self.running:
            self.running.remove(req)
        if req is self.chunked_req:
            self.chunked_req = None
        self._release(req, insert=reason.get("type") != "abort")
        self.logit_ctx.release(req)
        self.release_grammar(req)
        self.rid_to_req.pop(req.rid, None)
        self.stats["num_finished"] += 1
        if notify:
            out = build_output([req])
            if out is not None:
                self.send(out)

    def prepare_batch(self, mode: ForwardMode, reqs: list[Req],
                      input_ids: Optional[torch.Tensor] = None) -> ScheduleBatch:
        """The batch of `reqs` ready for the runner (a decode's `input_ids` may come from the
        device: the overlap schedule's), the adapters waiting requests will want prefetched,
        and any armed fault applied."""
        if mode.is_extend():
            batch = ScheduleBatch.prepare_extend(reqs, self.model_runner, self._evict,
                                                 keep_lora_ids=self.keep_resident_for(reqs),
                                                 logit_ctx=self.logit_ctx)
        else:
            batch = ScheduleBatch.prepare_decode(reqs, self.model_runner, self._evict, input_ids=input_ids,
                                                 logit_ctx=self.logit_ctx)
        self._prefetch_adapters(reqs)
        self._maybe_inject_fault(batch)
        return batch

    def run_batch(self, mode: ForwardMode, reqs: list[Req]) -> None:
        try:
            batch = self.prepare_batch(mode, reqs)
            self.process_batch(batch, self.model_runner.forward(batch.forward_batch))
        except Exception as e:  # a failed forward fails its batch, never the server (at tp 1)
            if self.tp_group.size > 1:
                raise RankFailure(
                    f"TP rank {self.tp_group.rank}: a batch of {len(reqs)} request(s) failed on this rank "
                    f"({type(e).__name__}: {e}); under tensor parallelism this stops the server, since "
                    "the other ranks would wait for this one forever"
                ) from e
            self.fail_requests(reqs, e)
            return
        news = build_output(reqs)
        if news is not None:
            self.send(news)

    def fail_requests(self, reqs: list[Req], e: Exception) -> None:
        """A forward of these requests raised: they end with a 500, the server goes on."""
        self.stats["num_forward_failures"] += 1
        logger.error("Forward failed for %d request(s): %s\n%s", len(reqs), e, traceback.format_exc())
        message = f"internal error while running the model: {type(e).__name__}: {e}"
        for req in reqs:
            if not req.finished:
                self.finish(req, {"type": "abort", "message": message, "status_code": 500})

    @property
    def _evict(self) -> Optional[Callable[[int], int]]:
        return self.prefix_cache.evict if self.prefix_cache is not None else None

    def _maybe_inject_fault(self, batch: ScheduleBatch) -> None:
        for fault in self.faults:
            if fault.where == "decode" and batch.is_extend:
                continue  # "decode": fail a later step of a running request (mid-stream)
            if any(fault.rid_substring in r.rid and len(r.output_ids) >= fault.after_tokens
                   for r in batch.reqs):
                self.faults.remove(fault)
                if fault.where == "hang":  # a forward that never returns (the progress watchdog's case)
                    while True:
                        time.sleep(3600)
                raise RuntimeError(f"injected fault for requests matching {fault.rid_substring!r}")

    # ------------------------------------------------------------------ info
    def ready_info(self) -> dict[str, Any]:
        mc = self.model_runner.model_config
        return {
            "max_total_num_tokens": self.max_total_num_tokens,
            "max_running_requests": self.max_running_requests,
            "context_len": self.model_runner.context_len,
            "vocab_size": mc.vocab_size,
            "eos_token_ids": sorted(self.stop_checker.eos_ids),
            "architectures": list(mc.architectures),
            "dtype": str(self.model_runner.dtype).replace("torch.", ""),
            "device": str(self.model_runner.device),
        }

    def live_info(self) -> dict[str, Any]:
        cache = self.prefix_cache
        return {
            "kv_free_tokens": self.allocator.available_size(),
            # Free or held by the cache but evictable: what new requests can get.
            "kv_available_tokens": self._kv_available(),
            "kv_cached_tokens": cache.tree.total_size if cache is not None else 0,
            "kv_evictable_tokens": cache.evictable_size if cache is not None else 0,
            "kv_used_tokens": self._kv_used(),
            "prefix_cache": cache.info() if cache is not None else {"enabled": False},
            "max_total_num_tokens": self.max_total_num_tokens,
            "num_running_reqs": len(self.running) + (self.chunked_req is not None),
            "num_waiting_reqs": len(self.waiting) + len(self.grammar_queue),  # grammar_queue: compiling
            "new_token_ratio": round(self.new_token_ratio, 4),
            "last_gen_throughput": round(self.last_gen_throughput, 2),
            "last_integrity_check": dict(self.last_integrity_check),
            "graph_stats": self.model_runner.graph_stats(),
            "forward_seconds": self.model_runner.clock.stats(),  # SGLANG_FORWARD_TIMES=1 (else None)
            **self.stats,
            **self.lora_info(),
            **self.grammar_info(),
        }
