"""The overlap schedule (`--enable-overlap-schedule`, a mixin of `Scheduler`): decode step N+1 is
built and launched before step N's tokens reach the host, so the scheduler's work between two
steps (the batch built, the outputs recorded, the news sent: ~0.8 ms at 64 requests on the H200
host, against a ~5 ms step) runs while the GPU computes.

A turn with a step N in flight:
  0. With requests waiting, admission plans a prefill as the ordinary turn would (the same
     budgets, LoRA slots and wait-turn counts; the KV and slots N's finishing requests still hold
     count as held). A prefill goes first, as in the ordinary schedule: N is finished, then the
     prefill runs; by default it is queued behind N instead (its inputs, metadata and launches
     prepared while N runs), then N's outputs are processed (while the prefill runs), then the
     prefill's. SGLANG_OVERLAP_PREFILL=0 finishes N first, then runs the prefill.
     Requests that cannot be admitted (the batch at --max-running-requests, their adapter waiting
     for a slot, KV short) do not stop the chain: the ordinary turn would decode the same requests.
  1. `_continuation`: which of N's requests step N+1 decodes. Those that stop by length after N
     are left out (known before N's tokens); one that stops on EOS or a stop string is not known
     to, so it is decoded once more and that token is thrown away. No continuation (every request
     stops, a prompt is being prefilled in chunks, KV runs short, a fault is armed, a request of N
     is constrained: its grammar mask needs N's token accepted first): N is finished alone and the
     next turn is an ordinary one.
  2. `_launch`: step N+1 feeds N's sampled tokens straight from the device (`prepare_decode`'s
     `input_ids`, a copy queued after N's sampling) and is queued behind N.
  3. `_finish`: N's host copies are waited for (N+1 runs meanwhile) and its outputs processed as
     an ordinary decode's. A request that stops here while N+1 is in flight holds one KV slot for
     a token it will never have (`Req.decode_ahead`); `Scheduler.finish` gives it back first, so
     the request leaves exactly what the ordinary schedule would have left (the prefix cache
     included). Its row in N+1 is skipped when N+1 finishes.
Everything else (retraction, adapter loads, cache flushes, faults, the rest of a chunked prompt)
runs with no step in flight: such a turn, or such a message, finishes N first (`drain_inflight`).

Greedy outputs equal the ordinary schedule's token for token. A sampled request draws with its own
seed per step (the pending token is counted), so a seeded request samples the same tokens too; an
unseeded one draws from the shared generator, whose noise then follows another batch shape.
A freed KV slot or row is reused by later launches only, which the stream orders after the step
that still writes or reads it. Single GPU: under tensor parallelism the ranks would have to agree
on every continuation, so there the flag is ignored with a warning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.configs.forward_batch_info import ForwardMode
from sglang.srt.managers.req import Req
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.scheduler_output import build_output
from sglang.srt.model_executor.launched_forward import LaunchedForward


@dataclass
class InflightStep:
    batch: ScheduleBatch
    launched: LaunchedForward


class SchedulerOverlapMixin:
    """Reads and updates the Scheduler's queues, model runner and stats."""

    inflight: Optional[InflightStep]  # the decode step launched and not finished (Scheduler.__init__: None)

    def overlap_turn(self) -> bool:
        """One turn of the overlap schedule; False when nothing was runnable."""
        prev = self.inflight
        if prev is None:
            batch = self.get_next_batch()
            if batch is None:
                return False
            mode, reqs = batch
            if mode.is_decode():
                self.inflight = self._launch(mode, reqs, None)
            else:
                self.run_batch(mode, reqs)
            return True
        if self.waiting and self.chunked_req is None and not self.faults:
            batch = self._plan_prefill()
            if batch is not None:
                self.inflight = None
                if not self.overlap_prefill:
                    self._finish(prev)
                    self.run_batch(*batch)
                    return True
                # The default: the prefill is queued behind the step in flight before
                # that step's outputs are processed: its host work (inputs, metadata, launches)
                # overlaps the step on the GPU, and the step's outputs are processed while it runs.
                prefill = self._launch(*batch, None)
                self._finish(prev)
                if prefill is not None:
                    self._finish(prefill)
                return True
        nxt = self._continuation(prev)
        self.inflight = self._launch(ForwardMode.DECODE, nxt, prev) if nxt else None
        self._finish(prev)
        return True

    def drain_inflight(self) -> None:
        """Finish the step in flight, if any (before anything that needs the requests at rest)."""
        prev, self.inflight = self.inflight, None
        if prev is not None:
            self._finish(prev)

    def _continuation(self, prev: InflightStep) -> Optional[list[Req]]:
        if self.chunked_req is not None or self.faults:
            return None  # an ordinary turn decides (the rest of the prompt first, or the fault's batch)
        if any(r.grammar is not None for r in prev.batch.reqs):
            # A constrained request's mask needs the token N samples, on the host and accepted by its
            # matcher: its batch goes step by step (N finished, then the next step built).
            return None
        reqs = [r for r in prev.batch.reqs if not r.finished and not self.stop_checker.stops_by_length(r, 1)]
        # One new KV slot each, from the free list: eviction and retraction are the ordinary turn's.
        if not reqs or self.allocator.available_size() < len(reqs):
            return None
        return reqs

    def _launch(self, mode: ForwardMode, reqs: list[Req], prev: Optional[InflightStep]) -> Optional[InflightStep]:
        """Queue a decode step of `reqs` (its input tokens from `prev`'s device output when given)
        or a prefill of them; None when it failed (its requests failed)."""
        try:
            tokens = None
            if prev is not None:
                tokens = prev.launched.sample.next_token_ids
                if len(reqs) < len(prev.batch.reqs):  # the rows of the requests that go on
                    keep = set(map(id, reqs))
                    rows = [i for i, r in enumerate(prev.batch.reqs) if id(r) in keep]
                    tokens = tokens.index_select(0, torch.tensor(rows, device=tokens.device))
            batch = self.prepare_batch(mode, reqs, tokens)
            if mode.is_decode():
                for r in reqs:
                    r.decode_ahead = 1 if prev is not None else 0
            launched = self.model_runner.launch_forward(batch.forward_batch)
        except Exception as e:  # a failed launch fails its requests, never the server
            self.fail_requests(reqs, e)
            return None
        if prev is not None:
            self.stats["overlapped_decode_steps"] += 1
        elif mode.is_extend():
            self.stats["overlapped_prefills"] += 1
        return InflightStep(batch, launched)

    def _finish(self, step: InflightStep) -> None:
        ahead = set(map(id, self.inflight.batch.reqs)) if self.inflight is not None else set()
        live = [r for r in step.batch.reqs if not r.finished]  # an abort may have come meanwhile
        for r in live:
            # From here on the request's tokens include this step's: only a step launched after
            # this one (`_launch` marked its requests) holds a slot ahead of them.
            if id(r) not in ahead:
                r.decode_ahead = 0
        try:
            self.process_batch(step.batch, self.model_runner.finish_forward(step.launched))
        except Exception as e:
            self.fail_requests(live, e)
            return
        news = build_output(live)
        if news is not None:
            self.send(news)
