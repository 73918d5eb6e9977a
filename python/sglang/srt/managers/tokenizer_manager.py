"""TokenizerManager: the main process's side of a request (DESIGN §3 step 1 and 5).

It validates and tokenises requests (chat templates come from the tokenizer), resolves adapter
names to ids, sends `TokenizedGenerateReqInput` to the scheduler, and turns the scheduler's
`BatchTokenIDOut` news into replies, detokenising incrementally. It lives on one asyncio loop; the
scheduler client's reader thread enters it only through `loop.call_soon_threadsafe`.
Adapter handling (names to ids, OpenAI model names, run-time loads) is in `tokenizer_lora.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterator, Optional, Union

from sglang.srt.configs.lora_ref import LoRAUpdateOutput
from sglang.srt.configs.run_configs import TokenizerManagerConfig
from sglang.srt.configs.tokenizer import load_tokenizer
from sglang.srt.lora.lora_registry import LoRARegistry
from sglang.srt.managers.detokenizer import IncrementalDetokenizer, token_bytes
from sglang.srt.managers.generate_request import (
    GenerateReqInput,
    InvalidRequestError,
    RequestFailedError,
    SingleGenerateReq,
)
from sglang.srt.managers.integrity import IntegrityLog, tokenizer_problems
from sglang.srt.managers.io_struct import (
    AbortReq,
    BatchTokenIDOut,
    FaultInjectionReq,
    FlushCacheOut,
    FlushCacheReq,
    GetServerInfoOut,
    GetServerInfoReq,
    TokenizedBatchReqInput,
    TokenizedGenerateReqInput,
)
from sglang.srt.managers.req_state import ReqState, iterate_states
from sglang.srt.managers.request_log import request_log_line
from sglang.srt.managers.scheduler_client import SchedulerClient
from sglang.srt.managers.tokenizer_grammar import GrammarChecker
from sglang.srt.managers.tokenizer_lora import TokenizerLoRAMixin
from sglang.srt.sampling.grammar_spec import GrammarSpec
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.utils import package_version

if TYPE_CHECKING:
    from concurrent.futures import Future

    from sglang.srt.managers.metrics import ServerMetrics

logger = logging.getLogger(__name__)

# Texts of at least this many characters are tokenised off the event loop (`off_loop`): ~1 ms of
# tokenising, below which the thread hand-over costs more than it saves.
OFF_LOOP_CHARS = 16384
# Abandoned requests awaiting the scheduler's last news; past this many the oldest is counted as is.
MAX_ABANDONED = 4096


class TokenizerManager(TokenizerLoRAMixin):
    def __init__(self, config: TokenizerManagerConfig, client: SchedulerClient, scheduler_info: dict[str, Any],
                 tokenizer: Optional[Future[Any]] = None) -> None:
        """`tokenizer`: its load, started while the scheduler started (launch_runtime); None: loaded here."""
        self.config = config
        self.client = client
        self.scheduler_info = scheduler_info
        self.context_len: int = scheduler_info["context_len"]
        self.max_total_num_tokens: int = scheduler_info["max_total_num_tokens"]
        self.vocab_size: int = scheduler_info["vocab_size"]
        self.served_model_name = config.served_model_name
        self.metrics: Optional["ServerMetrics"] = None
        if config.enable_metrics:
            # prometheus_client only where metrics are on (a GPU box without it serves without them).
            from sglang.srt.managers.metrics import ServerMetrics

            self.metrics = ServerMetrics(self.served_model_name)
        self.base_model_names = set(config.base_model_names)
        if tokenizer is not None:
            self.tokenizer = tokenizer.result()  # raises what load_tokenizer raised
        else:
            self.tokenizer = load_tokenizer(config.tokenizer) if config.tokenizer is not None else None
        # Constrained requests are compiled here before they are queued (tokenizer_grammar.py).
        self.grammar = GrammarChecker(config.grammar_backend, self.tokenizer, self.vocab_size,
                                      scheduler_info.get("eos_token_ids", ()))
        # The startup adapters with the ids the scheduler's LoRA manager has (both from the config).
        self.lora_registry = LoRARegistry(config.lora_refs) if config.lora_refs is not None else None
        self.rid_to_state: dict[str, ReqState] = {}
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.dead_reason: Optional[str] = None
        self._info_waiters: list[asyncio.Future] = []
        self._flush_waiters: list[asyncio.Future] = []
        self._lora_waiters: list[asyncio.Future] = []
        # One adapter load/unload at a time, so that e.g. "unload X" (waiting for X's in-flight
        # requests) and a following "load X" reach the scheduler in the order they were asked.
        self._lora_update_lock: Optional[asyncio.Lock] = None
        # Adapters whose unload waits for their requests: name -> done (a load of the name waits).
        self._unloading: dict[str, asyncio.Future] = {}
        # --lora-resolver-dir: loads on first use in progress (name -> the load), and the adapters
        # loaded that way with their last use (the least recent idle one makes room at the cap).
        self._resolving: dict[str, asyncio.Future] = {}
        self._resolved_use: dict[str, float] = {}
        # Requests between their first-use loads and their in-flight references, per name: such an
        # adapter is not idle, whatever the registry counts, so it is never chosen to make room.
        self._resolve_pending: dict[str, int] = {}
        self._waiting_rids: dict[str, int] = {}  # rid -> requests of it waiting for their adapters
        self._aborted_waiting: set[str] = set()  # of those, the ones /abort_request named
        # rids an /abort_request named while an OpenAI route checked their request (door()), for
        # generate() to end unsent.
        self._aborted_at_door: set[str] = set()
        self._resolve_lock: Optional[asyncio.Lock] = None
        self._token_text_cache: dict[int, str] = {}
        # Requests whose client went away, until the scheduler's news of their end: their rids are
        # still the scheduler's, and their tokens are counted then (metrics, request logs).
        self._abandoned: dict[str, ReqState] = {}
        self._tokenizer_thread: Optional[ThreadPoolExecutor] = None  # off_loop's, made on first use
        # Called (on the loop) when the scheduler dies; the HTTP server uses it to shut down.
        self.on_fatal: Optional[Callable[[], None]] = None
        # Set when the server is stopping (SIGTERM): new requests get a 503 with it.
        self.stopping_reason: Optional[str] = None
        # generate() calls in progress; when it drops to 0 the idle-time integrity check runs.
        self.num_active_requests = 0
        self.integrity_log = IntegrityLog(logger, "Tokenizer manager")
        self.check_integrity()
        # Test hooks (--enable-test-hooks) of this process: "tokenize" / "detokenize" faults.
        self.local_faults: list[FaultInjectionReq] = []

    # ------------------------------------------------------------------ wiring
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Attach to the event loop that serves requests and start receiving scheduler news."""
        self.loop = loop

        def on_message(msg: Any) -> None:
            loop.call_soon_threadsafe(self._handle_message, msg)

        def on_exit(reason: str) -> None:
            loop.call_soon_threadsafe(self._handle_scheduler_exit, reason)

        self.client.start_reader(on_message, on_exit)

    def is_healthy(self) -> bool:
        return self.dead_reason is None and self.client.is_alive()

    def _handle_message(self, msg: Any) -> None:
        if isinstance(msg, BatchTokenIDOut):
            for i, rid in enumerate(msg.rids):
                state = self.rid_to_state.get(rid)
                if state is None and rid in self._abandoned:
                    self._late_news(rid, msg, i)
                    continue
                # A state failed here (below) may still get the scheduler's news of its abort:
                # the client must see the failure, not a plain abort.
                if state is None or state.finished:
                    continue
                try:
                    if self.local_faults and self._take_local_fault("detokenize", rid):
                        raise RuntimeError(f"injected detokenizer fault for request {rid!r}")
                    state.apply(msg, i)
                    if self.metrics is not None and state.req.log_metrics:
                        first = msg.first_token_times[i] if msg.first_token_times else None
                        self.metrics.on_tokens(state, len(msg.output_ids[i]), time.time(), first)
                except Exception as e:  # fails this request only: the others of the message go on
                    logger.exception("Detokenizing the output of request %r failed", rid)
                    state.fail(f"internal error while detokenizing the output: {type(e).__name__}: {e}", 500)
                    if msg.finished_reasons[i] is None:
                        self.client.send(AbortReq(rid=rid))  # free its KV now
        elif isinstance(msg, GetServerInfoOut):
            self._resolve_first(self._info_waiters, msg.info)
        elif isinstance(msg, FlushCacheOut):
            self._resolve_first(self._flush_waiters, msg)
        elif isinstance(msg, LoRAUpdateOutput):
            self._resolve_first(self._lora_waiters, msg)
        else:
            logger.warning("unexpected message from the scheduler: %r", type(msg).__name__)

    @staticmethod
    def _resolve_first(waiters: list[asyncio.Future], value: Any) -> None:
        while waiters:
            fut = waiters.pop(0)
            if not fut.done():
                fut.set_result(value)
                return

    def _late_news(self, rid: str, msg: BatchTokenIDOut, i: int) -> None:
        """News of a request whose client went away: its token counts (a non-streaming request's
        tokens were never sent before it ended), and once it has ended there, its account."""
        state = self._abandoned[rid]
        state.completion_tokens = msg.completion_tokens[i]
        state.cached_tokens = msg.cached_tokens[i]
        if msg.finished_reasons[i] is not None:
            self._account(self._abandoned.pop(rid))

    def _account(self, state: ReqState) -> None:
        """Every request's life ends here (finished, failed or abandoned): counted and logged once."""
        if self.metrics is not None and state.req.log_metrics:
            self.metrics.on_finished(state, time.time())
        if self.config.log_requests:
            logger.info(request_log_line(state, self.config.log_requests_level))

    def begin_shutdown(self, grace: float, reason: str = "the server is shutting down") -> None:
        """The server is stopping (on the loop): new requests get a 503 at once, and requests still
        running after `grace` seconds end with a 503 (an error event, then [DONE], on a stream), so
        none is cut off mid-reply when the HTTP server stops."""
        if self.stopping_reason is not None:
            return
        self.stopping_reason = reason
        logger.info("Stopping: %d request(s) in flight get %.1f s to finish.", len(self.rid_to_state), grace)
        asyncio.get_running_loop().call_later(grace, self.fail_in_flight, reason, 503)

    def fail_in_flight(self, reason: str, status_code: int) -> None:
        """End every unfinished request with an error, and tell the scheduler to drop them."""
        for rid, state in list(self.rid_to_state.items()):
            if not state.finished:
                state.fail(reason, status_code)
                if self.dead_reason is None:
                    self.client.send(AbortReq(rid=rid))

    def close(self, reason: str) -> None:
        """The owner stopped the scheduler on purpose (Engine.shutdown, on the loop): the client
        does not report that exit, so end here, with `reason`, every request and control call still
        waiting for news that will not come, and refuse new ones."""
        self.stopping_reason = reason
        self._handle_scheduler_exit(reason)

    def _handle_scheduler_exit(self, reason: str) -> None:
        self.dead_reason = reason
        for rid in list(self._abandoned):  # no more news will come: count them as they stand
            self._account(self._abandoned.pop(rid))
        if self.stopping_reason is not None:
            # The scheduler got the stop signal too (a signal to the whole process group).
            self.fail_in_flight(self.stopping_reason, 503)
        for state in list(self.rid_to_state.values()):
            if not state.finished:
                state.fail(reason, 500)
        for fut in self._info_waiters + self._lora_waiters + self._flush_waiters:
            if not fut.done():
                fut.set_exception(RuntimeError(reason))
        if self.on_fatal is not None:
            self.on_fatal()

    # ------------------------------------------------------------------ tokenisation
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **template_kwargs: Any) -> str:
        if self.tokenizer is None:
            raise InvalidRequestError("chat requests need a tokenizer; the server runs with --skip-tokenizer-init",
                                      param="messages")
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError(
                "this model's tokenizer has no chat template; use /v1/completions with a plain prompt",
                param="messages",
            )
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
            )
        except Exception as e:  # template errors (e.g. a role order the template rejects)
            raise InvalidRequestError(f"could not apply the chat template: {e}", param="messages") from None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenise; bad text is a 400, a tokenizer failure a 500 that names the cause (logged)."""
        if self.tokenizer is None:
            raise InvalidRequestError(
                "this server runs with --skip-tokenizer-init: send 'input_ids' instead of text", param="text"
            )
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # e.g. a lone surrogate ("\ud800") from a JSON escape
            raise InvalidRequestError(f"the prompt is not valid Unicode text: {e}", param="prompt") from None
        try:
            if self.local_faults and self._take_local_fault("tokenize", text):
                raise RuntimeError("injected tokenizer fault")
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except Exception as e:
            logger.exception("Tokenizing a prompt of %d characters failed", len(text))
            raise RequestFailedError(f"internal error while tokenizing the prompt: {type(e).__name__}: {e}") from None

    def check_token_ids(self, ids: list[int], param: str) -> None:
        """A 400 naming the first id outside the vocabulary."""
        vocab = self.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"{param}: token id {bad} is outside the vocabulary [0, {vocab})",
                                      param=param)

    async def off_loop(self, fn: Callable[[], Any], chars: int) -> Any:
        """`fn()` (tokenising `chars` characters of text), in the tokenizer's own thread when the
        text is long: a multi-megabyte prompt takes seconds to tokenise, and on the event loop
        every other request (and /health) would wait for it. Short texts run inline (cheaper than
        the hand-over). One thread: the requests' tokenisations stay in arrival order."""
        if chars < OFF_LOOP_CHARS:
            return fn()
        if self._tokenizer_thread is None:
            self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn)

    def token_bytes(self, token_id: int) -> list[int]:
        """The raw bytes of one token (also of one that holds part of a UTF-8 character)."""
        piece = self.tokenizer.convert_ids_to_tokens(token_id) if self.tokenizer is not None else None
        return token_bytes(self.token_text(token_id), piece if isinstance(piece, str) else None)

    def token_text(self, token_id: int) -> str:
        text = self._token_text_cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""
            self._token_text_cache[token_id] = text
        return text

    def _prepare(self, req: SingleGenerateReq) -> tuple[list[int], SamplingParams]:
        """Validate one request and tokenise it. Raises InvalidRequestError (400)."""
        raw = req.sampling_params
        try:
            params = SamplingParams.from_dict(raw)
            params.verify(self.vocab_size)
        except ValueError as e:
            message = str(e)
            field = message.split(" ", 1)[0].split(".")[-1].strip(":")
            param = field if field in SamplingParams.__dataclass_fields__ else "sampling_params"
            raise InvalidRequestError(message, param=param) from None
        if not math.isfinite(params.temperature):
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {params.temperature!r}",
                                      param="temperature")
        if params.top_k >= self.vocab_size:
            params.top_k = -1  # keeping the whole vocabulary is no top-k (and fits the int64 tensor)
        if self.tokenizer is None and params.stop:
            raise InvalidRequestError("stop strings need a tokenizer; use stop_token_ids", param="stop")
        input_ids = req.input_ids if req.input_ids is not None else self.encode(req.text or "")
        n = len(input_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty (it tokenises to no tokens)", param="prompt")
        self.check_token_ids(input_ids, "input_ids")
        if n >= self.context_len:
            what = "is longer than" if n > self.context_len else "fills, leaving no room for output,"
            raise InvalidRequestError(
                f"The input ({n} tokens) {what} the model's context length ({self.context_len} tokens).",
                param="prompt",
            )
        limit, what = self.context_len, "the model's maximum context length"
        if self.max_total_num_tokens < limit:
            limit, what = self.max_total_num_tokens, "the KV cache capacity"
        if n >= limit:
            raise InvalidRequestError(
                f"The input ({n} tokens) does not fit in {what} ({limit} tokens).",
                param="prompt",
            )
        if params.max_new_tokens is None:
            params.max_new_tokens = limit - n  # "until the context": the room the prompt leaves
        if n + params.max_new_tokens > limit:
            if raw.get("max_new_tokens") is not None:
                raise InvalidRequestError(
                    f"Requested token count exceeds {what} of {limit} tokens. You requested a total of "
                    f"{n + params.max_new_tokens} tokens: {n} tokens from the input and "
                    f"{params.max_new_tokens} tokens for the completion. Please reduce the number of "
                    "tokens in the input or the completion.",
                    param="max_new_tokens",
                )
            params.max_new_tokens = limit - n  # the default budget shrinks to what fits
        if params.min_new_tokens > params.max_new_tokens:
            # Only a budget the server chose can be short here (SamplingParams checked a given one).
            raise InvalidRequestError(
                f"min_new_tokens ({params.min_new_tokens}) exceeds the {params.max_new_tokens} tokens that "
                f"{what} ({limit} tokens) leaves after the input ({n} tokens).",
                param="min_new_tokens",
            )
        if req.top_logprobs_num > self.config.max_top_logprobs:
            raise InvalidRequestError(
                f"top_logprobs_num must be at most {self.config.max_top_logprobs}, got {req.top_logprobs_num}",
                param="top_logprobs_num",
            )
        return input_ids, params

    async def check_grammar(self, spec: GrammarSpec, param: str) -> None:
        """A 400 naming `param` unless `spec` (a regex, JSON schema or EBNF grammar) compiles here."""
        await self.grammar.check(spec, param)

    # ------------------------------------------------------------------ generation
    async def generate(self, obj: GenerateReqInput, request: Any = None) -> AsyncIterator[Union[dict, list]]:
        """Run a request. Streaming yields one dict per update (with `index` for a batch);
        otherwise yields once: a dict, or a list for a batch. `request` (a Starlette request) lets a
        waiting request notice that its client disconnected."""
        if self.dead_reason is not None:
            raise RuntimeError(self.dead_reason)
        if self.stopping_reason is not None:
            raise RequestFailedError(self.stopping_reason, 503)
        self.num_active_requests += 1
        inner = self._generate(obj, request)
        try:
            async for out in inner:
                yield out
        finally:
            # Leaving `async for` early does not close `inner`: close it now, so its clean-up
            # (abort, adapter references) is done before the idle check below, not at GC time.
            await inner.aclose()
            self.num_active_requests -= 1
            if self.num_active_requests == 0:
                self.check_integrity()

    def _check_rid_free(self, rid: str) -> None:
        if rid in self.rid_to_state or rid in self._abandoned or rid in self._waiting_rids:
            raise InvalidRequestError(f"a request with rid {rid!r} is already running", param="rid")

    def _leave_waiting(self, key: str) -> bool:
        """One request of rid `key` stops waiting; whether /abort_request named it meanwhile."""
        aborted = key in self._aborted_waiting
        left = self._waiting_rids[key] - 1
        if left:
            self._waiting_rids[key] = left
        else:
            del self._waiting_rids[key]
            self._aborted_waiting.discard(key)
        return aborted

    @contextlib.contextmanager
    def door(self, rid: Optional[str]) -> Iterator[Callable[[], None]]:
        """An OpenAI route's request from its checks to its generate(). Those routes check the
        request's grammar before generate() (a compile can take seconds): meanwhile its rid counts
        as waiting, so a twin rid is a 400 and an /abort_request is kept. The route calls the
        yielded `admit()` right before generate(), which then ends an aborted request unsent."""
        if rid is None:
            yield lambda: None
            return
        self._check_rid_free(rid)
        self._waiting_rids[rid] = self._waiting_rids.get(rid, 0) + 1
        self.num_active_requests += 1  # in progress from here, as generate() counts its own
        held = True

        def admit() -> None:
            nonlocal held
            if held:
                held = False
                if self._leave_waiting(rid):
                    self._aborted_at_door.add(rid)

        try:
            yield admit
        finally:
            admit()
            self._aborted_at_door.discard(rid)  # generate() took it, or never came
            self.num_active_requests -= 1
            if self.num_active_requests == 0:
                self.check_integrity()

    async def _generate(self, obj: GenerateReqInput, request: Any) -> AsyncIterator[Union[dict, list]]:
        reqs, is_batch = obj.normalize()
        # Every prompt is valid before any is queued.
        chars = sum(len(r.text) for r in reqs if r.text is not None)
        prepared = await self.off_loop(lambda: [self._prepare(r) for r in reqs], chars)
        for r in reqs:
            self._check_rid_free(r.rid)
        # rids (and call rids) waiting for their grammar's check or their adapters (a compile or a
        # first-use load can take seconds): an /abort_request meanwhile is remembered, and such a
        # request is never sent.
        waiting = {r.rid for r in reqs} | {r.group_rid for r in reqs if r.group_rid is not None}
        for key in waiting:
            self._waiting_rids[key] = self._waiting_rids.get(key, 0) + 1
        try:
            for spec in dict.fromkeys(p.grammar for _, p in prepared if p.grammar is not None):
                await self.check_grammar(spec, spec.kind)  # n > 1 and batches share their specs' checks
            lora_ids = await self.acquire_adapters([r.lora_name for r in reqs])
        finally:
            aborted = {key for key in waiting if self._leave_waiting(key)} | (waiting & self._aborted_at_door)
            self._aborted_at_door -= waiting
        unowned = list(lora_ids)  # references not yet handed to a request state
        event = asyncio.Event()
        states: list[ReqState] = []
        outgoing: list[TokenizedGenerateReqInput] = []  # sent together, after every state is registered
        try:
            for i, (req, (input_ids, params), lora_id) in enumerate(zip(reqs, prepared, lora_ids)):
                detok = None
                if self.tokenizer is not None:
                    detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
                state = ReqState(req=req, input_ids=input_ids, params=params, lora_id=lora_id,
                                 detok=detok, event=event, prompt_tokens=len(input_ids))
                if lora_id is not None:
                    # Given back as the request ends (a client that stops reading its stream must
                    # not hold an unload up), and after any AbortReq: the scheduler sees the abort
                    # before the unload.
                    state.on_finish = functools.partial(self.release_adapters_now, [lora_id])
                    unowned[i] = None
                self.rid_to_state[req.rid] = state
                states.append(state)
                if req.rid in aborted or req.group_rid in aborted:
                    # Aborted while its adapter loaded: never sent, so no step can run it first.
                    state.abort_unsent()
                    continue
                outgoing.append(TokenizedGenerateReqInput(
                    rid=req.rid, input_ids=input_ids, sampling_params=params,
                    return_logprob=req.return_logprob,
                    logprob_start_len=req.logprob_start_len if req.return_logprob else -1,
                    top_logprobs_num=req.top_logprobs_num if req.return_logprob else 0,
                    lora_id=lora_id, stream=req.stream, cache_salt=req.cache_salt,
                ))
            if len(outgoing) == 1:
                self.client.send(outgoing[0])
            elif outgoing:
                self.client.send(TokenizedBatchReqInput(outgoing))
            async for out in iterate_states(states, is_batch, obj.stream, request, self.token_text):
                yield out
            if not all(state.finished for state in states) and not any(state.failed for state in states):
                # The wait ended early: the client disconnected. Nobody reads what follows; 499
                # (nginx's "client closed request") goes through the quiet RequestFailedError
                # handlers, streamed or not, instead of an ASGI traceback per disconnect.
                raise RequestFailedError("the client disconnected", status_code=499)
        finally:
            sibling_failed = any(state.failed for state in states)
            for state in states:
                self.rid_to_state.pop(state.req.rid, None)
                if not state.finished:
                    # The caller went away (disconnect, cancellation), or another request of the
                    # batch failed, which fails the reply: free its KV at once.
                    self.client.send(AbortReq(rid=state.req.rid))
                    if sibling_failed:
                        state.abort_for_failed_sibling()  # as the reply showed it
                    else:
                        state.fail("the client went away", 499)
                    if self.dead_reason is None:
                        # Counted when the scheduler's news of its end arrives (with its tokens);
                        # until then its rid is still taken there.
                        self._abandoned[state.req.rid] = state
                        if len(self._abandoned) > MAX_ABANDONED:
                            self._account(self._abandoned.pop(next(iter(self._abandoned))))
                        continue
                self._account(state)
            self.release_adapters_now(unowned)

    async def generate_one(self, obj: GenerateReqInput, request: Any = None) -> Union[dict, list]:
        """The non-streaming reply of `obj`."""
        obj.stream = False
        result: Union[dict, list, None] = None
        async for out in self.generate(obj, request):
            result = out
        assert result is not None  # a call ends with its reply, or raises (a disconnect: 499)
        return result

    # ------------------------------------------------------------------ control
    async def _ask_scheduler(self, msg: Any, waiters: list[asyncio.Future], timeout: float) -> Any:
        """Send `msg` and wait for its answer (the scheduler answers each kind in order)."""
        if not self.is_healthy():
            raise RuntimeError(self.dead_reason or "the scheduler is not running")
        fut = asyncio.get_running_loop().create_future()
        waiters.append(fut)
        self.client.send(msg)
        return await asyncio.wait_for(fut, timeout)

    async def get_scheduler_info(self, timeout: float = 30.0) -> dict[str, Any]:
        return await self._ask_scheduler(GetServerInfoReq(), self._info_waiters, timeout)

    async def flush_cache(self, timeout: float = 30.0) -> FlushCacheOut:
        """Empty the prefix cache; the scheduler refuses (success False, with the reason) while
        any request runs or waits."""
        return await self._ask_scheduler(FlushCacheReq(), self._flush_waiters, timeout)

    async def server_info(self) -> dict[str, Any]:
        """What /get_server_info and Engine.get_server_info report: the public server args, the
        scheduler's start-up facts and live counters, and this process's integrity check."""
        live = await self.get_scheduler_info()
        return {**self.config.public_args, **self.scheduler_info, **live,
                "tokenizer_integrity_check": self.check_integrity(), "version": package_version()}

    def inject_fault(self, rid_substring: str, where: str = "forward", after_tokens: int = 0,
                     tp_rank: Optional[int] = None) -> None:
        """Test hook: fail the next forward ("forward"; "decode": a decode step once the request
        has `after_tokens` output tokens; "hang": a forward that never returns) of a request whose
        rid contains `rid_substring` (on TP rank `tp_rank` only, if given), the next tokenisation
        of a text containing it ("tokenize"), or the next detokenisation of such a request's output
        ("detokenize")."""
        if not self.config.enable_test_hooks:
            raise InvalidRequestError("fault injection needs --enable-test-hooks")
        if where in ("tokenize", "detokenize"):
            self.local_faults.append(FaultInjectionReq(rid_substring=rid_substring, where=where))
        elif where in ("forward", "decode", "hang"):
            self.client.send(FaultInjectionReq(rid_substring=rid_substring, where=where, after_tokens=after_tokens,
                                               tp_rank=tp_rank))
        else:
            raise InvalidRequestError(f"'where' must be one of forward, decode, hang, tokenize, detokenize; got {where!r}",
                                      param="where")

    def _take_local_fault(self, where: str, text: str) -> bool:
        for fault in self.local_faults:
            if fault.where == where and fault.rid_substring in text:
                self.local_faults.remove(fault)
                return True
        return False

    def check_integrity(self) -> dict[str, Any]:
        """The main process's idle-time check (managers/integrity.py); ERROR-logs new problems."""
        problems, counts = tokenizer_problems(self.num_active_requests, self.rid_to_state, self.lora_registry)
        if not counts["idle"] and self.integrity_log.last:
            # Its invariants only hold when no request is in progress: keep the last idle result.
            return {**self.integrity_log.last, "now": counts}
        return self.integrity_log.record(problems, counts)

    def abort(self, rid: str) -> None:
        """Abort the request `rid`, and every request expanded from a call or prompt given that rid
        (its `n` > 1 samples R-0, R-1, ..., a batch's prompts)."""
        rids = [r for r, state in self.rid_to_state.items() if r == rid or state.req.group_rid == rid]
        if rid in self._waiting_rids:
            self._aborted_waiting.add(rid)  # still waiting for its grammar check or adapters: never sent
            if not rids:
                return  # nothing of it reached the scheduler
        for r in rids or [rid]:
            self.client.send(AbortReq(rid=r))

    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.config.model_path,
            "tokenizer_path": self.config.tokenizer.path if self.config.tokenizer is not None else self.config.model_path,
            "served_model_name": self.served_model_name,
            "is_generation": True,
            "context_length": self.context_len,
            "vocab_size": self.vocab_size,
            "architectures": self.scheduler_info.get("architectures"),
        }
