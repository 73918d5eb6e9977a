"""The scheduler: a loop in the child process that owns the ModelRunner (DESIGN §3 steps 2-5).

Each turn: take every pending message, then run one batch, prefill first (FCFS, chunked, within
the KV / row / token / LoRA budgets of schedule_policy.py), else one decode step of every running
request. When decode finds no free KV slot it *retracts* the newest running requests back to the
queue (they give their KV back and are prefilled again later, resuming where they stopped).
With the prefix cache (managers/prefix_cache.py, on unless --disable-radix-cache), admission
reuses cached prefixes, every prefill pass and every finished or retracted request leaves its KV
in the cache, and cached KV is evicted (least recently used first) before anything is retracted.
A forward that raises fails only the requests of its batch; the loop keeps serving. Under tensor
parallelism it is fatal instead (`RankFailure`): the other ranks may already wait in a collective
this rank will never join, so the rank exits and the parent brings the server down naming it.
"""

from __future__ import annotations

import bisect
import logging
import time
import traceback
from typing import Any, Callable, Optional

from sglang.srt.distributed import SINGLE_RANK, TensorParallelGroup
from sglang.srt.managers.integrity import IntegrityLog, scheduler_problems
from sglang.srt.configs.lora_ref import LoRAUpdateOutput
from sglang.srt.managers.io_struct import (
    AbortReq,
    FaultInjectionReq,
    FlushCacheOut,
    FlushCacheReq,
    GetServerInfoOut,
    GetServerInfoReq,
    LoadLoRAAdapterReq,
    ShutdownReq,
    TokenizedGenerateReqInput,
    UnloadLoRAAdapterReq,
)
from sglang.srt.managers.scheduler_lora import lora_server_info, prefetch_adapters, update_adapters
from sglang.srt.managers.prefix_cache import PrefixCache
from sglang.srt.managers.req import Req
from sglang.srt.managers.schedule_batch import ScheduleBatch, release_kv
from sglang.srt.managers.schedule_policy import (
    GroupedLoRAAdmission,
    PrefillBudget,
    longest_prefix_first,
    plan_prefill,
)
from sglang.srt.managers.scheduler_input import receive_messages
from sglang.srt.managers.scheduler_output import (
    StopChecker,
    build_output,
    record_output_token,
    record_prompt_logprobs,
)
from sglang.srt.configs.forward_batch_info import ForwardMode
from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

# new_token_ratio: the share of a running request's remaining budget that admission reserves.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.0015  # per decode step
IDLE_POLL_S = 1.0


class RankFailure(RuntimeError):
    """A batch failed on this tensor-parallel rank: the rank stops (see the module doc)."""


class Scheduler:
    def __init__(
        self,
        server_args: ServerArgs,
        recv_conn: Any,
        send_conn: Any,
        tp_group: TensorParallelGroup = SINGLE_RANK,
        gpu_id: int = 0,
    ) -> None:
        from sglang.srt.model_executor.model_runner import ModelRunner

        self.server_args = server_args
        # Under tensor parallelism only rank 0 has pipes: it receives and broadcasts, and replies.
        self.recv_conn = recv_conn
        self.send_conn = send_conn
        self.tp_group = tp_group
        self.model_runner = ModelRunner(server_args, gpu_id=gpu_id, tp_group=tp_group)
        mr = self.model_runner
        self.allocator = mr.token_to_kv_pool_allocator
        self.req_to_token_pool = mr.req_to_token_pool
        self.max_total_num_tokens = mr.max_total_num_tokens
        self.max_running_requests = min(server_args.max_running_requests or mr.max_running_requests,
                                        mr.max_running_requests)
        # Rows the pool can give to requests (the model runner may keep one as a padding row).
        self.total_rows = self.req_to_token_pool.available_size()
        tokenizer = None
        if not server_args.skip_tokenizer_init:
            from sglang.srt.managers.tokenizer_manager import load_tokenizer

            tokenizer = load_tokenizer(server_args)
        eos = set(mr.model_config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.stop_checker = StopChecker(eos, tokenizer, mr.context_len)
        validate = mr.lora_manager.validate_lora_batch if mr.lora_manager is not None else None
        self.lora_admission = GroupedLoRAAdmission(validate, server_args.lora_max_wait_turns)
        self.prefix_cache: Optional[PrefixCache] = None if server_args.disable_radix_cache else PrefixCache(mr)
        # --schedule-policy lpm ranks by cached prefix; without a cache there is nothing to rank.
        self.longest_prefix_first = server_args.schedule_policy == "lpm" and self.prefix_cache is not None
        if server_args.schedule_policy == "lpm" and self.prefix_cache is None:
            logger.info("--schedule-policy lpm with --disable-radix-cache: no prefix to rank, admitting FCFS")

        self.waiting: list[Req] = []  # FCFS by arrival
        self.running: list[Req] = []
        self.chunked_req: Optional[Req] = None
        self.rid_to_req: dict[str, Req] = {}
        self.arrivals = 0
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.faults: list[FaultInjectionReq] = []
        # Counters for /get_server_info. decode_reqs / decode_steps is the mean running batch (a
        # benchmark reads the change over its run).
        self.stats = {"num_retractions": 0, "num_forward_failures": 0, "num_finished": 0, "decode_steps": 0,
                      "decode_reqs": 0, "prefill_batches": 0, "prefill_tokens": 0}
        self.decode_tokens_since_log = 0
        self.last_decode_log = time.monotonic()
        self.last_gen_throughput = 0.0
        self.last_integrity_check: dict[str, Any] = {}
        self.integrity_log = IntegrityLog(logger, "Scheduler")
        self.was_idle = True
        self.check_integrity()

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
            "num_waiting_reqs": len(self.waiting),
            "new_token_ratio": round(self.new_token_ratio, 4),
            "last_gen_throughput": round(self.last_gen_throughput, 2),
            "last_integrity_check": dict(self.last_integrity_check),
            "graph_stats": self.model_runner.graph_stats(),
            **self.stats,
            **self.lora_info(),
        }

    def lora_info(self) -> dict[str, Any]:
        return lora_server_info(self.model_runner.lora_manager, (r.lora_id for r in self._holders()),
                                (r.lora_id for r in self.waiting))

    def _holders(self) -> list[Req]:
        return self.running + ([self.chunked_req] if self.chunked_req is not None else [])

    def _kv_available(self) -> int:
        evictable = self.prefix_cache.evictable_size if self.prefix_cache is not None else 0
        return self.allocator.available_size() + evictable

    def _kv_used(self) -> int:
        """KV slots held by running requests, directly or through the cached prefixes they lock."""
        return self.max_total_num_tokens - self._kv_available()

    def _release(self, req: Req, insert: bool) -> None:
        """Give back the request's KV and row; with the cache, what it computed is cached first
        when `insert` (a normal finish or a retraction, never an abort: its KV may be unwritten)."""
        if self.prefix_cache is not None:
            self.prefix_cache.release(req, insert)
        else:
            release_kv(req, self.model_runner)

    def check_integrity(self) -> dict[str, Any]:
        """Run the idle-time integrity check (managers/integrity.py); ERROR-logs new problems."""
        problems, counts = scheduler_problems(self)
        self.last_integrity_check = self.integrity_log.record(problems, counts)
        return self.last_integrity_check

    # ------------------------------------------------------------------ messages
    def send(self, msg: Any) -> None:
        if self.send_conn is not None:
            self.send_conn.send(msg)

    def process_messages(self, block: bool) -> bool:
        """Handle every pending message (the same on every TP rank); False once asked to shut down."""
        for msg in receive_messages(self.recv_conn, self.tp_group, IDLE_POLL_S if block else 0.0):
            if isinstance(msg, TokenizedGenerateReqInput):
                self.add_request(msg)
            elif isinstance(msg, AbortReq):
                self.abort_request(msg.rid)
            elif isinstance(msg, GetServerInfoReq):
                self.send(GetServerInfoOut(info=self.live_info()))
            elif isinstance(msg, FaultInjectionReq):
                # A fault may target one TP rank only: the case of a failure the others never see.
                if self.server_args.enable_test_hooks and msg.tp_rank in (None, self.tp_group.rank):
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
        self.waiting.append(req)

    def abort_request(self, rid: str) -> None:
        req = self.rid_to_req.get(rid)
        if req is None:
            return  # already finished
        if req in self.waiting:
            self.waiting.remove(req)
        # Tell the tokenizer manager: after /abort_request a caller may still be waiting (after a
        # disconnect nobody is, and the news is dropped there).
        self.finish(req, {"type": "abort", "message": "the request was aborted"})

    def update_lora(self, msg: Any) -> LoRAUpdateOutput:
        lora = self.model_runner.lora_manager
        out = update_adapters(lora, msg, self.tp_group)
        if isinstance(msg, UnloadLoRAAdapterReq) and out.success and self.prefix_cache is not None:
            # Adapter ids are unique per load: nothing can match the unloaded one's entries again.
            if self.prefix_cache.drop_namespaces(lambda ns: ns.lora_id is not None and ns.lora_id not in lora.refs):
                self._recheck_if_idle()
        return out

    def _recheck_if_idle(self) -> None:
        """Keep the reported idle-time check current after memory moved while idle."""
        if not (self.waiting or self.running or self.chunked_req):
            self.check_integrity()

    def flush_cache(self) -> FlushCacheOut:
        busy = len(self.running) + len(self.waiting) + (self.chunked_req is not None)
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
    def finish(self, req: Req, reason: dict[str, Any], notify: bool = True) -> None:
        req.finished_reason = reason
        if req in self.running:
            self.running.remove(req)
        if req is self.chunked_req:
            self.chunked_req = None
        self._release(req, insert=reason.get("type") != "abort")
        self.rid_to_req.pop(req.rid, None)
        self.stats["num_finished"] += 1
        if notify:
            out = build_output([req])
            if out is not None:
                self.send(out)

    def retract_for_decode(self) -> None:
        """Retract the newest running requests until every remaining one gets a KV slot (cached
        KV counts as available: it is evicted first)."""
        retracted = []
        while self.running and self._kv_available() < len(self.running):
            newest = max(self.running, key=lambda r: r.arrival)
            self.running.remove(newest)
            self._release(newest, insert=True)
            bisect.insort(self.waiting, newest, key=lambda r: r.arrival)
            retracted.append(newest)
        if retracted:
            old = self.new_token_ratio
            # Reserve more for the requests still running, so admission stops over-committing.
            self.new_token_ratio = 1.0
            self.stats["num_retractions"] += len(retracted)
            logger.warning(
                "KV cache pool is full. Retract requests. #retracted-req: %d, #running-req: %d, "
                "#new-token-ratio: %.4f -> %.4f", len(retracted), len(self.running), old, self.new_token_ratio,
            )

    # ------------------------------------------------------------------ batches
    def get_next_batch(self) -> Optional[tuple[ForwardMode, list[Req]]]:
        """Prefill first; else decode every running request (retracting if KV ran out)."""
        if self.waiting or self.chunked_req is not None:
            batch = self._plan_prefill()
            if batch is not None:
                return batch
        if not self.running:
            return None
        self.retract_for_decode()
        if not self.running:
            return None
        return ForwardMode.DECODE, list(self.running)

    def _plan_prefill(self) -> Optional[tuple[ForwardMode, list[Req]]]:
        holders = self._holders()
        self.lora_admission.begin({r.lora_id for r in holders}, self.waiting, holders)
        holding = len(self.running) + (self.chunked_req is not None)
        chunk = self.server_args.chunked_prefill_size
        if self.prefix_cache is not None:
            self.prefix_cache.begin_turn()
        budget = PrefillBudget(
            kv_free=self._kv_available(),
            rows_free=self.req_to_token_pool.available_size(),
            max_new_reqs=self.max_running_requests - holding,
            max_prefill_tokens=self.server_args.max_prefill_tokens,
            chunk_size=None if chunk == -1 else min(chunk, self.server_args.max_prefill_tokens),
            new_token_ratio=self.new_token_ratio,
        )
        waiting = self.waiting
        if self.longest_prefix_first:
            waiting = longest_prefix_first(waiting, self.prefix_cache.cached_len)
        plan = plan_prefill(
            self.lora_admission.order(waiting), self.chunked_req, self.running, budget, self.lora_admission,
            self.prefix_cache,
        )
        if plan.reqs:
            admitted = {id(r) for r in plan.reqs}
            self.waiting = [r for r in self.waiting if id(r) not in admitted]
            self.chunked_req = plan.chunked
            return ForwardMode.EXTEND, plan.reqs
        return None

    def run_batch(self, mode: ForwardMode, reqs: list[Req]) -> None:
        try:
            if mode.is_extend():
                lora = self.model_runner.lora_manager
                if lora is not None:
                    # Make the adapters of the decoding requests resident together with this
                    # batch's (admission made sure they fit), so that the pool, which sees one
                    # forward batch at a time, does not evict them for a prefill only to load them
                    # back at the next decode step.
                    lora.fetch_new_loras({r.lora_id for r in self._holders()} | {r.lora_id for r in reqs})
                batch = ScheduleBatch.prepare_extend(reqs, self.model_runner, self._evict)
            else:
                batch = ScheduleBatch.prepare_decode(reqs, self.model_runner, self._evict)
            self._prefetch_adapters(reqs)
            self._maybe_inject_fault(batch)
            out = self.model_runner.forward(batch.forward_batch)
            if batch.is_extend:
                self.process_extend(batch, out)
            else:
                self.process_decode(batch, out)
        except Exception as e:  # a failed forward fails its batch, never the server (at tp 1)
            if self.tp_group.size > 1:
                raise RankFailure(
                    f"TP rank {self.tp_group.rank}: a batch of {len(reqs)} request(s) failed on this rank "
                    f"({type(e).__name__}: {e}); under tensor parallelism this stops the server, since "
                    "the other ranks would wait for this one forever"
                ) from e
            self.stats["num_forward_failures"] += 1
            logger.error("Forward failed for %d request(s): %s\n%s", len(reqs), e, traceback.format_exc())
            message = f"internal error while running the model: {type(e).__name__}: {e}"
            for req in reqs:
                if not req.finished:
                    self.finish(req, {"type": "abort", "message": message, "status_code": 500})
            return
        news = build_output(reqs)
        if news is not None:
            self.send(news)

    def _prefetch_adapters(self, reqs: list[Req]) -> None:
        if self.model_runner.lora_manager is None or not self.waiting:
            return
        protected = {r.lora_id for r in self._holders()} | {r.lora_id for r in reqs}
        prefetch_adapters(self.model_runner.lora_manager, self.lora_admission, self.waiting, protected)

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
                raise RuntimeError(f"injected fault for requests matching {fault.rid_substring!r}")

    def process_extend(self, batch: ScheduleBatch, out: Any) -> None:
        next_ids = out.next_token_ids.tolist()
        for i, req in enumerate(batch.reqs):
            if req.return_logprob:
                record_prompt_logprobs(
                    req, batch.logprob_targets[i],
                    out.input_token_logprobs[i] if out.input_token_logprobs else None,
                    out.input_top_logprobs[i] if out.input_top_logprobs else None,
                )
            if req.kv_len < req.fill_len:
                continue  # a chunk of a longer prompt: its sampled token means nothing
            req.prompt_logprobs_done = True
            if req.max_new_tokens == 0:
                self.finish(req, {"type": "length", "length": 0}, notify=False)
                continue
            if not self._append_token(req, out, i, next_ids[i]) and req not in self.running:
                self.running.append(req)
        self.stats["prefill_batches"] += 1
        self.stats["prefill_tokens"] += batch.forward_batch.extend_num_tokens
        if self.prefix_cache is not None:
            self.prefix_cache.cache_unfinished([r for r in batch.reqs if not r.finished])
        self._log_prefill(batch, out.used_cuda_graph)

    def _append_token(self, req: Req, out: Any, i: int, token: int) -> bool:
        """Record row i's sampled token (and logprobs); finish the request if it stops. Returns
        whether it finished."""
        record_output_token(
            req, token,
            out.next_token_logprobs[i] if out.next_token_logprobs else None,
            out.next_token_top_logprobs[i] if out.next_token_top_logprobs else None,
        )
        reason = self.stop_checker.check(req)
        if reason is not None:
            self.finish(req, reason, notify=False)
        return reason is not None

    def process_decode(self, batch: ScheduleBatch, out: Any) -> None:
        next_ids = out.next_token_ids.tolist()
        for i, req in enumerate(batch.reqs):
            self._append_token(req, out, i, next_ids[i])
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        self.stats["decode_steps"] += 1
        self.stats["decode_reqs"] += len(batch.reqs)
        self.decode_tokens_since_log += len(batch.reqs)
        if self.stats["decode_steps"] % self.server_args.decode_log_interval == 0:
            self._log_decode(len(batch.reqs), out.used_cuda_graph)

    # ------------------------------------------------------------------ logs
    def _usage(self) -> float:
        return self._kv_used() / self.max_total_num_tokens

    def _log_prefill(self, batch: ScheduleBatch, used_cuda_graph: bool) -> None:
        logger.info(
            "Prefill batch, #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
            "#running-req: %d, #queue-req: %d, cuda graph: %s",
            len(batch.reqs), batch.forward_batch.extend_num_tokens,
            self.prefix_cache.turn_hit_tokens if self.prefix_cache is not None else 0,
            self._usage(), len(self.running), len(self.waiting), bool(used_cuda_graph),
        )

    def _log_decode(self, batch_size: int, used_cuda_graph: bool) -> None:
        now = time.monotonic()
        self.last_gen_throughput = self.decode_tokens_since_log / max(now - self.last_decode_log, 1e-9)
        self.decode_tokens_since_log = 0
        self.last_decode_log = now
        logger.info(
            "Decode batch, #running-req: %d, #token: %d, token usage: %.2f, cuda graph: %s, "
            "gen throughput (token/s): %.2f, #queue-req: %d",
            batch_size, self._kv_used(), self._usage(), bool(used_cuda_graph), self.last_gen_throughput,
            len(self.waiting),
        )

    # ------------------------------------------------------------------ loop
    def event_loop(self) -> None:
        stalled = False
        while True:
            idle = not (self.waiting or self.running or self.chunked_req)
            if idle and not self.was_idle:
                self.check_integrity()
                self.last_decode_log = time.monotonic()
                self.decode_tokens_since_log = 0
            self.was_idle = idle
            if not self.process_messages(block=idle or stalled):
                return
            batch = self.get_next_batch()
            # Nothing runnable (e.g. every waiting request waits for an adapter slot): only a
            # message can change that, so wait for one instead of spinning.
            stalled = batch is None
            if batch is not None:
                self.run_batch(*batch)
