"""What the scheduler does with a forward's results: append tokens and logprobs, check the stop
conditions, and pack the news for the tokenizer manager into `BatchTokenIDOut`."""

from __future__ import annotations

import math
import time
from typing import Any, Optional

from sglang.srt.managers.detokenizer import find_stop_string
from sglang.srt.managers.io_struct import BatchTokenIDOut
from sglang.srt.managers.req import Req
from sglang.srt.configs.runner_output import TopLogprobs


# What a logprob of -inf is reported as: strict JSON has no infinities (OpenAI-style servers
# commonly use this floor).
LOGPROB_FLOOR = -9999.0


def json_logprob(value: Any) -> Optional[float]:
    """A logprob as strict JSON can carry it: -inf becomes LOGPROB_FLOOR, NaN (a numerical fault)
    becomes None, so one bad value never turns a whole response into a serialisation error."""
    v = float(value)
    if math.isnan(v):
        return None
    return LOGPROB_FLOOR if v == -math.inf else v


def _top_pairs(top: Optional[TopLogprobs]) -> list[tuple[Optional[float], int]]:
    if top is None:
        return []
    vals, ids = top
    return [(json_logprob(v), int(i)) for v, i in zip(vals, ids)]


class StopChecker:
    """EOS, `stop_token_ids`, stop strings and `max_new_tokens`, in that order of precedence; only
    the length before `min_new_tokens` tokens."""

    def __init__(self, eos_ids: set[int], tokenizer: Any, context_len: int) -> None:
        self.eos_ids = eos_ids
        self.tokenizer = tokenizer
        self.context_len = context_len

    def check(self, req: Req) -> Optional[dict[str, Any]]:
        params = req.sampling_params
        token = req.output_ids[-1]
        if len(req.output_ids) <= params.min_new_tokens:
            # EOS and stop_token_ids were held back from the choice of the first min_new_tokens
            # tokens; a stop string must end in text after theirs.
            return self._length_stop(req)
        if token in params.stop_token_ids:
            return {"type": "stop", "matched": token}
        if not params.ignore_eos and token in self.eos_ids:
            return {"type": "stop", "matched": token}
        if params.stop and self.tokenizer is not None:
            tail, protected = self._tail_text(req)
            matched = find_stop_string(tail, params.stop, protected)
            if matched is not None:
                return {"type": "stop", "matched": matched}
        return self._length_stop(req)

    def _length_stop(self, req: Req) -> Optional[dict[str, Any]]:
        if self.stops_by_length(req):
            if len(req.output_ids) >= req.sampling_params.max_new_tokens:
                return {"type": "length", "length": req.sampling_params.max_new_tokens}
            return {"type": "length", "length": len(req.output_ids)}
        return None

    def stops_by_length(self, req: Req, more: int = 0) -> bool:
        """Whether `req` stops for its length once `more` further tokens are appended (whatever
        they are): what the overlap schedule knows before a step's tokens reach the host."""
        return (len(req.output_ids) + more >= req.sampling_params.max_new_tokens
                or req.fill_len + more >= self.context_len)

    def _tail_text(self, req: Req) -> tuple[str, int]:
        """The text of the last tokens, and how many of its characters come from the first
        min_new_tokens tokens (where a stop string does not count)."""
        # A stop string of c characters spans at most 4c byte-level tokens; one more token keeps
        # a partial character at the window's start from hiding a match.
        params = req.sampling_params
        longest = max(len(s) for s in params.stop)
        start = max(0, len(req.output_ids) - (4 * longest + 1))
        text = self.tokenizer.decode(req.output_ids[start:], skip_special_tokens=params.skip_special_tokens)
        protected = 0
        if start < params.min_new_tokens:
            protected = len(self.tokenizer.decode(req.output_ids[start:params.min_new_tokens],
                                                  skip_special_tokens=params.skip_special_tokens))
        return text, protected


def record_prompt_logprobs(req: Req, targets: list[int], values: Optional[list[float]],
                           tops: Optional[list[TopLogprobs]]) -> None:
    if not targets or values is None:
        return
    req.input_token_logprobs.extend((json_logprob(v), int(t)) for v, t in zip(values, targets))
    if req.top_logprobs_num > 0:
        if tops is None:
            req.input_top_logprobs.extend([] for _ in targets)
        else:
            req.input_top_logprobs.extend(_top_pairs(t) for t in tops)


def record_output_token(req: Req, token: int, logprob: Optional[float], top: Optional[TopLogprobs]) -> None:
    req.output_ids.append(int(token))
    if req.first_token_time is None:
        req.first_token_time = time.time()
    if req.return_logprob:
        req.output_token_logprobs.append((None if logprob is None else json_logprob(logprob), int(token)))
        if req.top_logprobs_num > 0:
            req.output_top_logprobs.append(_top_pairs(top))


def build_output(reqs: list[Req]) -> Optional[BatchTokenIDOut]:
    """News for every request with something to report: streaming requests with new tokens, and
    every finished request. Non-streaming requests report once, when they finish."""
    chosen = [
        r for r in reqs
        if r.finished or (r.stream and (len(r.output_ids) > r.sent_output_len))
    ]
    if not chosen:
        return None
    want_lp = any(r.return_logprob for r in chosen)
    out = BatchTokenIDOut(rids=[], finished_reasons=[], output_ids=[], prompt_tokens=[],
                          completion_tokens=[], cached_tokens=[])
    for r in chosen:
        out.rids.append(r.rid)
        out.finished_reasons.append(r.finished_reason)
        out.output_ids.append(r.output_ids[r.sent_output_len:])
        out.prompt_tokens.append(len(r.origin_input_ids))
        out.completion_tokens.append(len(r.output_ids))
        out.cached_tokens.append(r.cached_tokens)
        out.first_token_times.append(r.first_token_time)
        r.sent_output_len = len(r.output_ids)
        if not want_lp:
            continue
        send_input = r.return_logprob and not r.sent_input_logprobs and r.prompt_logprobs_done
        out.input_token_logprobs.append(list(r.input_token_logprobs) if send_input else None)
        out.input_top_logprobs.append(
            list(r.input_top_logprobs) if send_input and r.top_logprobs_num > 0 else None
        )
        if send_input:
            r.sent_input_logprobs = True
        if r.return_logprob:
            start = r.sent_output_logprob_len
            out.output_token_logprobs.append(r.output_token_logprobs[start:])
            out.output_top_logprobs.append(r.output_top_logprobs[start:] if r.top_logprobs_num > 0 else None)
            r.sent_output_logprob_len = len(r.output_token_logprobs)
        else:
            out.output_token_logprobs.append(None)
            out.output_top_logprobs.append(None)
    return out
