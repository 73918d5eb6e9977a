"""Constrained decoding in the scheduler (a mixin of `Scheduler`).

A request with a regex, JSON schema or EBNF grammar (the tokenizer manager has already checked that
it compiles) gets its own matcher before it is admitted. Its spec is compiled here once (the same
spec again is a cache hit: constrained/cache.py); a compile runs in a worker thread while the loop
serves the others, and until it is done the request waits in `grammar_queue`, outside `waiting`.
When rank 0 sees compiles done it says so in a `GrammarReady` message ahead of the turn's others,
which every tensor-parallel rank receives at the same turn (scheduler_input.py), so every rank
admits the request at the same turn (a rank whose own compile is slower waits for it there).

Then, each step, the batch's constrained rows get their matcher's bitmask (schedule_batch.py,
sampling/grammar_mask.py) and after sampling each matcher accepts its request's token
(`grammar_stop`); the grammar complete and its stop token (EOS) accepted, the request stops. A
matcher lives as long as its request: a retracted request keeps it (it resumes with its output
tokens, which the matcher has accepted), and a finished or aborted one drops it
(`release_grammar`); the integrity check counts them. Under tensor parallelism every rank's matcher
accepts the token rank 0 chose (ModelRunner broadcasts it), so the masks stay the same everywhere.
"""

from __future__ import annotations

import bisect
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

from sglang.srt.constrained.backends import create_grammar_backend, how_to_enable
from sglang.srt.constrained.base import GrammarError
from sglang.srt.constrained.cache import GrammarCache
from sglang.srt.managers.integrity import Problem
from sglang.srt.managers.req import Req
from sglang.srt.sampling.grammar_spec import KIND_NAMES, GrammarSpec

logger = logging.getLogger("sglang.srt.managers.scheduler")

# How long rank 0 waits for a message while nothing runs but compiles (the loop then notices a
# finished compile within this time; idle, it would wait IDLE_POLL_S).
GRAMMAR_POLL_S = 0.002


@dataclass
class GrammarReady:
    """Rank 0's news that these queued requests' grammars are compiled (their order: the queue's)."""

    rids: list[str]


class SchedulerGrammarMixin:
    """Reads the Scheduler's config, model runner and `waiting`; owns `grammar_queue`."""

    def init_grammar(self, tokenizer: Any, eos_ids: set[int]) -> None:
        # No tokenizer (--skip-tokenizer-init): the tokenizer manager refuses constrained requests.
        self.grammar_backend = None
        if tokenizer is not None:
            self.grammar_backend = create_grammar_backend(
                self.config.grammar_backend, tokenizer, self.model_runner.model_config.vocab_size, eos_ids)
        self.grammar_cache: Optional[GrammarCache] = (
            GrammarCache(self.grammar_backend.size_of) if self.grammar_backend is not None else None)
        self.grammar_queue: list[Req] = []  # waiting for their compile, in arrival order
        self._grammar_compiles: dict[GrammarSpec, Future] = {}  # specs being compiled
        self._grammar_thread: Optional[ThreadPoolExecutor] = None
        self.grammar_matchers = 0  # matchers held by requests (the integrity check compares)

    # ------------------------------------------------------------------ admission
    def queue_request(self, req: Req) -> None:
        """A new request: to `waiting`, or first to `grammar_queue` while its grammar compiles."""
        spec = req.sampling_params.grammar
        if spec is None:
            self.waiting.append(req)
            return
        if self.grammar_backend is None:  # the tokenizer manager refuses these first
            self.finish(req, {"type": "abort", "status_code": 400,
                              "message": f"constrained decoding is off on this server; to enable it, {how_to_enable()}"})
            return
        outcome = self.grammar_cache.get(spec)
        if outcome is not None:
            self._start_grammar(req, outcome)
            return
        if spec not in self._grammar_compiles:
            if self._grammar_thread is None:
                self._grammar_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
            self._grammar_compiles[spec] = self._grammar_thread.submit(self.grammar_backend.compile, spec)
        self.grammar_queue.append(req)

    def ready_grammar_rids(self) -> list[str]:
        """(rank 0) The queued requests whose compile is done."""
        return [r.rid for r in self.grammar_queue if self._grammar_compiles[r.sampling_params.grammar].done()]

    def on_grammar_ready(self, msg: GrammarReady) -> None:
        queued = {r.rid: r for r in self.grammar_queue}
        for rid in msg.rids:
            req = queued.get(rid)
            if req is None:
                continue  # aborted since (on every rank alike)
            spec = req.sampling_params.grammar
            outcome = self.grammar_cache.get(spec)  # stored by a request before it in this message
            if outcome is None:
                try:
                    outcome = self._grammar_compiles[spec].result()  # rank 0 saw it done; another rank may wait
                    self.grammar_cache.put(spec, outcome)
                except GrammarError as e:
                    outcome = e
                    self.grammar_cache.put(spec, e)
                except Exception as e:  # the backend failed, not the spec: not kept
                    logger.exception("Compiling the %s of request %r failed", spec.kind, rid)
                    outcome = e
            self._leave_grammar_queue(req)
            self._start_grammar(req, outcome)

    def _start_grammar(self, req: Req, outcome: Any) -> None:
        """Give `req` a matcher of the compiled grammar and queue it, or fail it with the compile's error."""
        if isinstance(outcome, GrammarError):
            self.finish(req, {"type": "abort", "status_code": 400,
                              "message": f"Invalid {KIND_NAMES[req.sampling_params.grammar.kind]}: {outcome}"})
            return
        if isinstance(outcome, BaseException):
            self.finish(req, {"type": "abort", "status_code": 500, "message": "internal error while compiling the "
                              f"grammar: {type(outcome).__name__}: {outcome}"})
            return
        req.grammar = self.grammar_backend.matcher(outcome)
        self.grammar_matchers += 1
        bisect.insort(self.waiting, req, key=lambda r: r.arrival)

    def _leave_grammar_queue(self, req: Req) -> None:
        self.grammar_queue.remove(req)
        spec = req.sampling_params.grammar
        if not any(r.sampling_params.grammar == spec for r in self.grammar_queue):
            self._grammar_compiles.pop(spec, None)  # nobody waits for it (a compile in progress ends unread)

    # ------------------------------------------------------------------ per token
    def grammar_stop(self, req: Req, token: int) -> Optional[dict[str, Any]]:
        """`req`'s matcher accepts its new token: the finish reason when the grammar ends the request
        (its stop token accepted), or a failure if the token is outside the grammar (a bug: the mask
        allowed only tokens it accepts)."""
        if req.grammar is None:
            return None
        if not req.grammar.accept_token(token):
            logger.error("Request %r sampled token %d, which its grammar does not allow", req.rid, token)
            return {"type": "abort", "status_code": 500,
                    "message": f"internal error: the sampled token {token} is outside the request's grammar"}
        if req.grammar.is_terminated():
            return {"type": "stop", "matched": token}
        return None

    def release_grammar(self, req: Req) -> None:
        """The request has ended: it drops its matcher, or its place in the compile queue."""
        if req.grammar is not None:
            req.grammar = None
            self.grammar_matchers -= 1
        if req in self.grammar_queue:
            self._leave_grammar_queue(req)

    # ------------------------------------------------------------------ reports
    def grammar_problems(self, tracked: list[Req], idle: bool) -> tuple[list[Problem], dict[str, Any]]:
        """Matchers held against the requests tracked (queued, running or waiting for a compile)."""
        problems: list[Problem] = []
        held = sum(1 for r in tracked if r.grammar is not None)
        if held != self.grammar_matchers:
            problems.append(("grammar_matchers", f"{self.grammar_matchers} grammar matcher(s) live, "
                                                 f"{held} held by queued or running requests"))
        for req in self.grammar_queue:
            if req.grammar is not None or req.req_pool_idx is not None:
                problems.append(("grammar_queue", f"request {req.rid!r} waits for its grammar but holds a "
                                                  "matcher or KV"))
        if idle and self._grammar_compiles:
            problems.append(("grammar_queue", f"{len(self._grammar_compiles)} compile(s) tracked with no "
                                              "request waiting for them"))
        return problems, {"grammar_matchers": self.grammar_matchers, "grammar_queue": len(self.grammar_queue)}

    def grammar_info(self) -> dict[str, Any]:
        cache = self.grammar_cache
        return {"grammar_backend": self.grammar_backend.name if self.grammar_backend is not None else "none",
                "grammar_queue": len(self.grammar_queue), "grammar_matchers": self.grammar_matchers,
                "grammar_cache": cache.info() if cache is not None else None}
