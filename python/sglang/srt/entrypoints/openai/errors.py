"""The OpenAI error envelope `{"error": {"message", "type", "param", "code"}}` for every failure.

`code` is always the HTTP status as an int, as SGLang and vLLM send it (OpenAI's own API sends a
string or null there); the message says what went wrong.

Installed on the whole app (native endpoints included), so validation errors, malformed JSON,
unknown routes and internal errors all reach the client in the same shape.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from sglang.srt.entrypoints import json_text
from sglang.srt.entrypoints.json_text import JSONBody
from sglang.srt.managers.generate_request import InvalidRequestError, RequestFailedError

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


def error_body(message: str, status_code: int = 400, param: Optional[str] = None,
               err_type: Optional[str] = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": err_type or _TYPES.get(status_code, "invalid_request_error" if status_code < 500 else "internal_server_error"),
            "param": param,
            "code": status_code,
        }
    }


def error_response(message: str, status_code: int = 400, param: Optional[str] = None,
                   err_type: Optional[str] = None,
                   headers: Optional[dict[str, str]] = None) -> JSONBody:
    return JSONBody(error_body(message, status_code, param, err_type), status_code=status_code,
                        headers=headers)


def sse_error(message: str, status_code: int = 400, param: Optional[str] = None) -> str:
    """An error inside an SSE stream (the status line has already been sent)."""
    return f"data: {json_text.dumps(error_body(message, status_code, param))}\n\n"


def exception_to_response(exc: BaseException) -> JSONBody:
    """Map an exception raised while serving a request to its envelope."""
    if isinstance(exc, InvalidRequestError):
        return error_response(exc.message, exc.status_code, exc.param)
    if isinstance(exc, RequestFailedError):
        return error_response(exc.message, exc.status_code)
    if isinstance(exc, ValueError):
        return error_response(str(exc), 400)
    logger.exception("internal error while serving a request", exc_info=exc)
    return error_response(f"Internal server error: {type(exc).__name__}: {exc}", 500)


def describe_validation_errors(errors: list[dict[str, Any]]) -> tuple[str, Optional[str]]:
    """One readable line per validation problem (pydantic / FastAPI error dicts); the first bad
    field becomes `param`."""
    parts: list[str] = []
    param: Optional[str] = None
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            ctx = err.get("ctx") or {}
            detail = ctx.get("error", err.get("msg", "invalid JSON"))
            return f"The request body is not valid JSON: {detail}", None
        # Union members add their type name to the location; it only confuses the reader.
        loc = [p for p in loc if not (p[:1].isupper() or "[" in p or p in ("str", "int", "float", "bool"))]
        field = ".".join(loc)
        if param is None and loc:
            param = loc[0]
        msg = err.get("msg", "invalid value")
        if err.get("type") == "value_error" and msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]  # our own validators' messages read better without it
        if err.get("type") == "missing":
            parts.append(f"'{field}' is a required field")
        elif field:
            parts.append(f"{field}: {msg} (got {_short(err.get('input'))})")
        else:
            parts.append(msg)
    # A union reports one error per member; keep each line once.
    parts = list(dict.fromkeys(parts))
    return "; ".join(parts) or "invalid request", param


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONBody:
        message, param = describe_validation_errors(list(exc.errors()))
        return error_response(message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONBody:
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"Not found: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed for {request.url.path}"
        return error_response(message, exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, exc: InvalidRequestError) -> JSONBody:
        return exception_to_response(exc)

    # A request the server failed (its cause is logged where it happened). Handled here rather
    # than by the catch-all below, which Starlette re-raises to uvicorn as a second traceback.
    @app.exception_handler(RequestFailedError)
    async def _failed(request: Request, exc: RequestFailedError) -> JSONBody:
        return exception_to_response(exc)

    @app.exception_handler(ValueError)
    async def _value(request: Request, exc: ValueError) -> JSONBody:
        return exception_to_response(exc)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONBody:
        return exception_to_response(exc)
