"""Per-request state in the main process: what has arrived from the scheduler, and the reply dicts.

The reply is the native `/generate` dict (DESIGN §7): `text`, `output_ids`, and `meta_info` with
the token counts, the finish reason and, when asked, the logprobs as `[logprob, token_id, text]`.
While streaming, every chunk carries the cumulative state (SGLang's `/generate` convention); the
OpenAI layers turn it into deltas.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional, Union

from sglang.srt.managers.detokenizer import IncrementalDetokenizer, visible_text
from sglang.srt.managers.generate_request import SingleGenerateReq
from sglang.srt.managers.io_struct import BatchTokenIDOut
from sglang.srt.sampling.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# How often a waiting request checks whether its client has gone away.
DISCONNECT_POLL_S = 1.0

# How a request of a batch (or n > 1) ends when another request of it failed: aborted unfinished,
# since the reply is that failure. No status code of its own: the reply's error is the failure's,
# whatever the failed request's place in the batch (the routes report the first failure they meet).
SIBLING_FAILED_ABORT = {"type": "abort", "message": "another request of its batch failed"}


@dataclass
class ReqState:
    req: SingleGenerateReq
    input_ids: list[int]
    params: SamplingParams
    lora_id: Optional[str]
    detok: Optional[IncrementalDetokenizer]
    event: asyncio.Event
    output_ids: list[int] = field(default_factory=list)
    finished_reason: Optional[dict[str, Any]] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    input_token_logprobs: list[tuple[Optional[float], int]] = field(default_factory=list)
    input_top_logprobs: list[Any] = field(default_factory=list)
    output_token_logprobs: list[tuple[Optional[float], int]] = field(default_factory=list)
    output_top_logprobs: list[Any] = field(default_factory=list)
    dirty: bool = False
    # Called once, when the request ends (its scheduler news, or a failure): the adapter reference
    # goes back then, not when a slow client has read the last event.
    on_finish: Optional[Callable[[], None]] = None
    created: float = field(default_factory=time.time)
    last_token_time: Optional[float] = None  # when the latest output token arrived (metrics)
    # Characters of text from the first min_new_tokens tokens: a stop string ending within them
    # does not count (the scheduler's StopChecker agrees).
    protected_chars: int = 0

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def failed(self) -> bool:
        """Ended by a failure with an error status (not an /abort_request abort)."""
        reason = self.finished_reason
        return reason is not None and reason.get("type") == "abort" and bool(reason.get("status_code"))

    # ------------------------------------------------------------------ incoming news
    def apply(self, msg: BatchTokenIDOut, i: int) -> None:
        new_ids = list(msg.output_ids[i])
        reason = msg.finished_reasons[i]
        self.output_ids.extend(new_ids)
        self.prompt_tokens = msg.prompt_tokens[i]
        self.completion_tokens = msg.completion_tokens[i]
        self.cached_tokens = msg.cached_tokens[i]
        if msg.input_token_logprobs and msg.input_token_logprobs[i] is not None:
            self.input_token_logprobs = list(msg.input_token_logprobs[i])
        if msg.input_top_logprobs and msg.input_top_logprobs[i] is not None:
            self.input_top_logprobs = list(msg.input_top_logprobs[i])
        if msg.output_token_logprobs and msg.output_token_logprobs[i] is not None:
            self.output_token_logprobs.extend(msg.output_token_logprobs[i])
        if msg.output_top_logprobs and msg.output_top_logprobs[i] is not None:
            self.output_top_logprobs.extend(msg.output_top_logprobs[i])
        if self.detok is not None:
            text_ids = new_ids
            if (reason is not None and reason.get("type") == "stop" and isinstance(reason.get("matched"), int)
                    and not (self.params.no_stop_trim or self.params.include_stop_str_in_output)
                    and text_ids and text_ids[-1] == reason["matched"]):
                text_ids = text_ids[:-1]  # a matched stop token is not part of the text, unless asked for
            held = self.params.min_new_tokens - len(self.detok.ids)
            self.detok.add(text_ids)
            if 0 < held <= len(text_ids):
                # The text of the first min_new_tokens tokens, where stop strings do not count
                # (decoded whole, as the scheduler's StopChecker measures it).
                self.protected_chars = len(self.detok.decode_prefix(self.params.min_new_tokens))
            if reason is not None:
                self.detok.flush()
        self.finished_reason = reason
        self.dirty = True
        self.event.set()
        if reason is not None:
            self._ended()

    def fail(self, message: str, status_code: int = 500) -> None:
        self._finish({"type": "abort", "message": message, "status_code": status_code})

    def abort_for_failed_sibling(self) -> None:
        """End a request whose batch's reply is another request's failure (SIBLING_FAILED_ABORT)."""
        self._finish(dict(SIBLING_FAILED_ABORT))

    def abort_unsent(self) -> None:
        """End a request /abort_request named before it reached the scheduler (while its adapter
        loaded): the same reply as an abort there, with no token generated."""
        self._finish({"type": "abort", "message": "the request was aborted"})

    def _finish(self, reason: dict[str, Any]) -> None:
        """End the request here, without news from the scheduler."""
        self.finished_reason = reason
        self.dirty = True
        self.event.set()
        self._ended()

    def _ended(self) -> None:
        callback, self.on_finish = self.on_finish, None
        if callback is not None:
            callback()

    # ------------------------------------------------------------------ replies
    def text(self) -> str:
        if self.detok is None:
            return ""
        return visible_text(self.detok.text, self.params.stop, self.finished,
                            trim_stop=not self.params.no_stop_trim, protected=self.protected_chars,
                            keep_stop=self.params.include_stop_str_in_output)

    def to_dict(self, token_text: Callable[[int], str]) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.req.rid,
            "finish_reason": self.finished_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "e2e_latency": round(time.time() - self.created, 6),
        }
        if self.lora_id is not None:
            meta["lora_path"] = self.req.lora_name
        if self.req.return_logprob:
            with_text = self.req.return_text_in_logprobs
            meta["input_token_logprobs"] = _entries(self.input_token_logprobs, with_text, token_text)
            meta["output_token_logprobs"] = _entries(self.output_token_logprobs, with_text, token_text)
            if self.req.top_logprobs_num > 0:
                meta["input_top_logprobs"] = [
                    None if top is None else _entries(top, with_text, token_text)
                    for top in self.input_top_logprobs
                ]
                meta["output_top_logprobs"] = [
                    _entries(top, with_text, token_text) for top in self.output_top_logprobs
                ]
        return {"text": self.text(), "output_ids": list(self.output_ids), "meta_info": meta}


def _entries(pairs: list, with_text: bool, token_text: Callable[[int], str]) -> list[list[Any]]:
    return [[lp, tid, token_text(tid) if with_text else None] for lp, tid in pairs]


async def iterate_states(states: list[ReqState], is_batch: bool, stream: bool, request: Any,
                         token_text: Callable[[int], str]) -> AsyncIterator[Union[dict, list]]:
    """Wait for the news of `states` (which share one event). Streaming yields a cumulative dict
    per update (with `index` in a batch); otherwise yields once at the end (a dict, or a list for
    a batch). Returns early, yielding nothing more, if `request`'s client disconnects; unstreamed,
    also as soon as one request of a batch failed, since the reply is then that error: the others
    are left unfinished, for the caller to abort, and the reply shows them so aborted."""
    event = states[0].event
    while True:
        if not any(s.dirty for s in states):
            try:
                await asyncio.wait_for(event.wait(), timeout=DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if request is not None and await request.is_disconnected():
                    logger.info("client disconnected; aborting %d request(s)", len(states))
                    return
                continue
        event.clear()
        if stream:
            for i, state in enumerate(states):
                if state.dirty:
                    state.dirty = False
                    out = state.to_dict(token_text)
                    if is_batch:
                        out["index"] = i
                    yield out
        else:
            for state in states:
                state.dirty = False
        # News may arrive while we are suspended at a `yield` (the final one included): stop only
        # once the finished state has been delivered.
        if all(s.finished and not s.dirty for s in states):
            break
        if not stream and any(s.failed for s in states):
            break
    if not stream:
        outs = [s.to_dict(token_text) for s in states]
        for state, out in zip(states, outs):
            if not state.finished:
                # The wait ended at a failure: the caller aborts this one. An Engine caller reads
                # the list itself, and must not be told it still runs (finish_reason None).
                out["meta_info"]["finish_reason"] = dict(SIBLING_FAILED_ABORT)
        yield outs if is_batch else outs[0]
