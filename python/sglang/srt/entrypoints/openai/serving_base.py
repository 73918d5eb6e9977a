"""Pieces shared by the OpenAI completions and chat handlers."""

from __future__ import annotations

import logging
import re
from contextlib import contextmanager
from typing import Any, AsyncIterator, Iterator, Optional

from fastapi.responses import StreamingResponse

from sglang.srt.entrypoints import json_text
from sglang.srt.entrypoints.openai.errors import sse_error
from sglang.srt.managers.generate_request import InvalidRequestError, RequestFailedError

logger = logging.getLogger(__name__)

SSE_DONE = "data: [DONE]\n\n"


def sse(payload: Any) -> str:
    if hasattr(payload, "model_dump"):
        payload = payload.model_dump(exclude_none=False)
    return f"data: {json_text.dumps(payload)}\n\n"


def server_failure(out: dict[str, Any]) -> Optional[RequestFailedError]:
    """The error of a `/generate` reply that the server failed (an abort with a status code), else
    None (a request aborted on purpose, through /abort_request, is a normal reply)."""
    reason = out["meta_info"]["finish_reason"] or {}
    if reason.get("type") == "abort" and reason.get("status_code"):
        return RequestFailedError(reason.get("message") or "the request failed", int(reason["status_code"]))
    return None


def finish_reason(out: dict[str, Any]) -> tuple[Optional[str], Any]:
    """(OpenAI finish_reason, matched stop) of a `/generate` reply; raises for aborted requests."""
    reason = out["meta_info"]["finish_reason"]
    if reason is None:
        return None, None
    kind = reason.get("type")
    if kind == "abort":
        failure = server_failure(out)
        if failure is not None:
            raise failure
        return "abort", None  # aborted on request (/abort_request)
    return ("length" if kind == "length" else "stop"), reason.get("matched")


async def prime(agen: Any) -> tuple[Any, AsyncIterator[Any]]:
    """Take the first item now, so request errors (and a request the server failed before its
    first token) surface as an error status before the stream's 200 is sent."""
    try:
        first = await agen.__anext__()
        failure = server_failure(first) if isinstance(first, dict) else None
        if failure is not None:
            raise failure
    except BaseException:
        await agen.aclose()
        raise

    async def rest() -> AsyncIterator[Any]:
        try:
            yield first
            async for item in agen:
                yield item
        finally:
            await agen.aclose()  # at once (abort, adapter references), not when garbage-collected

    return first, rest()


def stream_error(e: BaseException) -> str:
    """The SSE error event for an exception raised mid-stream (after the 200 was sent)."""
    if isinstance(e, (InvalidRequestError, RequestFailedError)):
        return sse_error(e.message, e.status_code, getattr(e, "param", None))
    if type(e) is RuntimeError:  # the scheduler went away: its reason is the whole story
        return sse_error(str(e), 500)
    logger.error("Streaming a reply failed", exc_info=e)  # a bug: keep the traceback
    return sse_error(f"internal error while streaming the reply: {type(e).__name__}: {e}", 500)


def streaming_response(chunks: Any, source: Any = None) -> StreamingResponse:
    """SSE of `chunks` (made from the replies of `source`), ending in [DONE] or an error event."""
    async def guarded() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
        except Exception as e:  # a failed request or the scheduler gone: an error event, then [DONE]
            yield stream_error(e)
        finally:
            # An error raised while handling a reply leaves `source` suspended: close it now, so
            # the request's clean-up (abort, adapter references) runs at once, not at GC time.
            await chunks.aclose()
            if source is not None:
                await source.aclose()
        yield SSE_DONE

    return StreamingResponse(guarded(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def stop_list(stop: Any) -> Optional[list[str]]:
    if stop is None:
        return None
    return [stop] if isinstance(stop, str) else list(stop)


# Extensions that other engines (vLLM, SGLang) honour and that change the output. The request
# models accept unknown fields (clients send many this server has no use for), so these would be
# ignored silently without this list.
UNSUPPORTED_EXTENSIONS = {
    # /generate's names, sent by clients that reuse their sampling_params: ignored, max_new_tokens
    # would leave the route's own budget (16 tokens, or chat's "until the context") in force.
    "max_new_tokens": "max_new_tokens is the name on /generate; the OpenAI routes take max_tokens "
                      "(chat also max_completion_tokens)",
    "min_new_tokens": "min_new_tokens is the name on /generate; the OpenAI routes take min_tokens",
    # vLLM's sampling extensions this server does not implement.
    "allowed_token_ids": "allowed_token_ids is not supported (logit_bias can ban tokens)",
    "bad_words": "bad_words is not supported",
    "prompt_logprobs": "prompt_logprobs is not supported; on /v1/completions, echo with logprobs returns them",
    "use_beam_search": "beam search is not supported",
    "length_penalty": "length_penalty (beam search) is not supported",
    "truncate_prompt_tokens": "truncate_prompt_tokens is not supported",
    "return_tokens_as_token_ids": "return_tokens_as_token_ids is not supported",
    "logits_processors": "logits_processors is not supported",
    # vLLM's chat `echo` (the last message before the reply); /v1/completions declares its own echo.
    "echo": "echo is not supported on chat completions",
    # Constrained decoding's fields (response_format, regex, guided_json, ...): structured_outputs.py.
}


# Values of those extensions that ask for nothing (clients send some by default), so not refused.
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False,), "length_penalty": (1, 1.0), "bad_words": ([],),
    "return_tokens_as_token_ids": (False,), "logits_processors": ([],),
    "echo": (False,),  # vLLM's chat default, sent by clients built for vLLM
}


# Those of them that are flags: a value of another type is a type error, not a request for the feature.
BOOLEAN_EXTENSIONS = frozenset({"use_beam_search", "return_tokens_as_token_ids", "echo"})


@contextmanager
def openai_param_names(names: dict[str, str]) -> Iterator[None]:
    """Errors raised by the shared request path name the native `/generate` fields
    (`max_new_tokens`, `input_ids`); on an OpenAI route the `param`, and the message where it
    names such a field, name the route's own (`max_tokens`, `prompt`). Only the snake_case names
    are rewritten in the message: `text` is also a plain word there."""
    try:
        yield
    except InvalidRequestError as e:
        if e.route_terms:
            raise
        e.param = names.get(e.param, e.param) if e.param is not None else None
        fields = [native for native in names if "_" in native]
        if fields:
            pattern = re.compile(r"\b(" + "|".join(map(re.escape, fields)) + r")\b")
            e.message = pattern.sub(lambda m: names[m.group(1)], e.message)
            e.args = (e.message,)
        raise


def continuous_usage(request: Any) -> bool:
    """Whether every streamed chunk carries the usage so far (vLLM's `continuous_usage_stats`,
    which, as there, takes effect with `include_usage`)."""
    options = getattr(request, "stream_options", None)
    return options is not None and options.include_usage and options.continuous_usage_stats


def reject_unsupported(request: Any) -> None:
    """Refuse, rather than silently ignore, options that would change the output."""
    extra = getattr(request, "model_extra", None) or {}
    for name, message in UNSUPPORTED_EXTENSIONS.items():
        value = extra.get(name)
        if name in BOOLEAN_EXTENSIONS and value is not None and not isinstance(value, bool):
            raise InvalidRequestError(f"{name} must be a boolean, got {value!r}", param=name)
        if value is not None and not any(value == v and type(value) is type(v) for v in NEUTRAL_VALUES.get(name, ())):
            raise InvalidRequestError(message, param=name, route_terms=True)
    options = getattr(request, "stream_options", None)
    if options is not None:
        if not request.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", param="stream_options")
    top_k = getattr(request, "top_k", None)
    if top_k is not None and (top_k == 0 or top_k < -1):
        raise InvalidRequestError(f"top_k must be -1 (disabled) or a positive integer, got {top_k}", param="top_k")
