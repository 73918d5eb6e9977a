"""What the scheduler does after a forward (a mixin of `Scheduler`): record every request's
sampled token and logprobs, finish the requests that stop, grow the prefix cache, and log the
batch lines SGLang users read (`Prefill batch, ...`, `Decode batch, ...`). The per-request pieces
are in scheduler_output.py."""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

from sglang.srt.configs.runner_output import ModelRunnerOutput
from sglang.srt.managers.req import Req
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.scheduler_output import record_output_token, record_prompt_logprobs

# The scheduler's own logger: these mixins are parts of the Scheduler, and operators filter its
# log lines ("Prefill batch, ...") by that name.
logger = logging.getLogger("sglang.srt.managers.scheduler")


class SchedulerOutputMixin:
    """Reads the Scheduler's stop checker, queues, prefix cache and config; updates `running`,
    `stats` and the decode-log counters."""

    def process_batch(self, batch: ScheduleBatch, out: ModelRunnerOutput) -> None:
        if batch.is_extend:
            self.process_extend(batch, out)
        else:
            self.process_decode(batch, out)

    def process_extend(self, batch: ScheduleBatch, out: ModelRunnerOutput) -> None:
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

    def process_decode(self, batch: ScheduleBatch, out: ModelRunnerOutput) -> None:
        next_ids = out.next_token_ids.tolist()
        # The log line describes the step that ran: its KV is read before finished requests free theirs.
        log_now = (self.stats["decode_steps"] + 1) % self.config.decode_log_interval == 0
        kv_used = self._kv_used() if log_now else 0
        for i, req in enumerate(batch.reqs):
            if not req.finished:  # (overlap schedule) an abort, or a stop found the step before
                self._append_token(req, out, i, next_ids[i])
        self.decay_new_token_ratio()
        self.stats["decode_steps"] += 1
        self.stats["decode_reqs"] += len(batch.reqs)
        self.decode_tokens_since_log += len(batch.reqs)
        if log_now:
            self._log_decode(len(batch.reqs), kv_used, out.used_cuda_graph)

    def _append_token(self, req: Req, out: Any, i: int, token: int) -> bool:
        """Record row i's sampled token (and logprobs); finish the request if it stops. Returns
        whether it finished."""
        record_output_token(
            req, token,
            out.next_token_logprobs[i] if out.next_token_logprobs else None,
            out.next_token_top_logprobs[i] if out.next_token_top_logprobs else None,
        )
        # The grammar first: its matcher must see every token, and its end stops the request even
        # under ignore_eos or before min_new_tokens (the grammar allowed nothing else).
        reason = self.grammar_stop(req, token)
        if reason is None:
            reason = self.stop_checker.check(req)
        if reason is not None:
            self.finish(req, reason, notify=False)
        return reason is not None

    # ------------------------------------------------------------------ logs
    def _usage(self, used: Optional[int] = None) -> float:
        return (self._kv_used() if used is None else used) / self.max_total_num_tokens

    def _log_prefill(self, batch: ScheduleBatch, used_cuda_graph: bool) -> None:
        logger.info(
            "Prefill batch, #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
            "#running-req: %d, #queue-req: %d, cuda graph: %s",
            len(batch.reqs), batch.forward_batch.extend_num_tokens,
            self.prefix_cache.turn_hit_tokens if self.prefix_cache is not None else 0,
            self._usage(), len(self.running), len(self.waiting), bool(used_cuda_graph),
        )

    def _log_decode(self, batch_size: int, kv_used: int, used_cuda_graph: bool) -> None:
        now = time.monotonic()
        self.last_gen_throughput = self.decode_tokens_since_log / max(now - self.last_decode_log, 1e-9)
        self.decode_tokens_since_log = 0
        self.last_decode_log = now
        logger.info(
            "Decode batch, #running-req: %d, #token: %d, token usage: %.2f, cuda graph: %s, "
            "gen throughput (token/s): %.2f, #queue-req: %d",
            batch_size, kv_used, self._usage(kv_used), bool(used_cuda_graph), self.last_gen_throughput,
            len(self.waiting),
        )
