"""Pieces shared by the OpenAI completions and chat handlers."""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Optional

from fastapi.responses import StreamingResponse

from sglang.srt.entrypoints.openai.errors import sse_error
from sglang.srt.managers.generate_request import InvalidRequestError, RequestFailedError

SSE_DONE = "data: [DONE]\n\n"


def sse(payload: Any) -> str:
    if hasattr(payload, "model_dump"):
        payload = payload.model_dump(exclude_none=False)
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def finish_reason(out: dict[str, Any]) -> tuple[Optional[str], Any]:
    """(OpenAI finish_reason, matched stop) of a `/generate` reply; raises for aborted requests."""
    reason = out["meta_info"]["finish_reason"]
    if reason is None:
        return None, None
    kind = reason.get("type")
    if kind == "abort":
        if reason.get("status_code"):  # the server failed it
            raise RequestFailedError(reason.get("message") or "the request failed", int(reason["status_code"]))
        return "abort", None  # aborted on request (/abort_request)
    return ("length" if kind == "length" else "stop"), reason.get("matched")


async def prime(agen: AsyncIterator[Any]) -> tuple[Any, AsyncIterator[Any]]:
    """Take the first item now, so request errors surface before the stream's 200 is sent."""
    first = await agen.__anext__()

    async def rest() -> AsyncIterator[Any]:
        yield first
        async for item in agen:
            yield item

    return first, rest()


def streaming_response(chunks: AsyncIterator[str]) -> StreamingResponse:
    async def guarded() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
        except (InvalidRequestError, RequestFailedError) as e:
            yield sse_error(e.message, e.status_code, getattr(e, "param", None))
        except RuntimeError as e:  # the scheduler went away mid-stream
            yield sse_error(str(e), 500)
        yield SSE_DONE

    return StreamingResponse(guarded(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def stop_list(stop: Any) -> Optional[list[str]]:
    if stop is None:
        return None
    return [stop] if isinstance(stop, str) else list(stop)


def reject_unsupported(request: Any) -> None:
    """Refuse, rather than silently ignore, options that would change the output."""
    if getattr(request, "logit_bias", None):
        raise InvalidRequestError("logit_bias is not supported", param="logit_bias")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(request, name, None)
        if value not in (None, 0, 0.0):
            raise InvalidRequestError(f"{name} is not supported (only 0)", param=name)
    rp = getattr(request, "repetition_penalty", None)
    if rp not in (None, 1, 1.0):
        raise InvalidRequestError("repetition_penalty is not supported (only 1.0)", param="repetition_penalty")
    top_k = getattr(request, "top_k", None)
    if top_k is not None and (top_k == 0 or top_k < -1):
        raise InvalidRequestError(f"top_k must be -1 (disabled) or a positive integer, got {top_k}", param="top_k")
