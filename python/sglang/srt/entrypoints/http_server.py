"""The HTTP server: native endpoints (`/generate`, health, info) and the OpenAI-compatible API.

uvicorn runs the FastAPI app on the main thread's event loop; the scheduler runs in a child
process. SIGINT/SIGTERM make uvicorn stop accepting requests, and then the scheduler is shut down
and reaped before the process exits.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
import socket
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

import sglang
from sglang.srt.entrypoints.engine import launch_runtime
from sglang.srt.entrypoints.json_text import JSONBody
from sglang.srt.entrypoints.openai.errors import (
    describe_validation_errors,
    error_body,
    error_response,
    install_error_handlers,
    sse_error,
)
from sglang.srt.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from sglang.srt.entrypoints.openai.serving_base import prime, server_failure, sse, streaming_response
from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
from sglang.srt.entrypoints.openai.serving_completions import OpenAIServingCompletion
from sglang.srt.entrypoints.openai.serving_tokenize import OpenAIServingTokenize
from sglang.srt.managers.generate_request import GenerateReqInput, InvalidRequestError, ModelNotFoundError
from sglang.srt.configs.lora_ref import LoRAUpdateOutput
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

# Routes reachable without the API key: load-balancer probes and the Prometheus scrape (as
# upstream SGLang and vLLM leave them open).
PUBLIC_PATHS = ("/health", "/health_generate", "/metrics")
HEALTH_GENERATE_TIMEOUT_S = 30.0


async def _json_body(request: Request) -> Any:
    body = await request.body()
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequestError(f"The request body is not valid JSON: {e}") from None
    except RecursionError:  # json's decoder recurses once per nesting level
        raise InvalidRequestError("The request body is not valid JSON: it is nested too deeply") from None


class APIKeyMiddleware:
    """Require `Authorization: Bearer <key>` on every route but the public ones (plain ASGI, so
    streaming responses and disconnect detection pass through untouched)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    def _authorized(self, header: bytes) -> bool:
        scheme, _, token = header.strip().partition(b" ")
        # The scheme is case-insensitive (RFC 7235); the key is compared in constant time.
        return hmac.compare_digest(token.strip(), self.expected) and scheme.lower() == b"bearer"

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS and scope["method"] != "OPTIONS":
            given = dict(scope.get("headers") or ()).get(b"authorization", b"")
            if not self._authorized(given):
                response = error_response(
                    "Invalid or missing API key. Send it as 'Authorization: Bearer <key>'.",
                    401, headers={"WWW-Authenticate": "Bearer"},
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _validate(model: type[BaseModel], data: Any) -> Any:
    if not isinstance(data, dict):
        raise InvalidRequestError(f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        message, param = describe_validation_errors(e.errors(include_url=False))
        raise InvalidRequestError(message, param=param) from None


def _abort_error(result: Any) -> Optional[JSONBody]:
    """An error reply when the server failed any request of the result (a request aborted on
    purpose, through /abort_request, is a normal reply with finish_reason type "abort")."""
    for out in result if isinstance(result, list) else [result]:
        failure = server_failure(out)
        if failure is not None:
            return error_response(failure.message, failure.status_code)
    return None


def _lora_update_response(out: LoRAUpdateOutput, status: int) -> JSONBody:
    """`{success, error_message, loaded_adapters}`; a refusal also carries the OpenAI error
    envelope under "error", so both SGLang-style and OpenAI-style clients can read it."""
    body: dict[str, Any] = {
        "success": out.success, "error_message": out.error_message, "loaded_adapters": out.loaded_adapters,
    }
    if not out.success:
        body.update(error_body(out.error_message, status, param="lora_name" if status == 404 else None))
    return JSONBody(body, status_code=status)


def create_app(tm: TokenizerManager, server_args: ServerArgs) -> FastAPI:
    completions = OpenAIServingCompletion(tm)
    chat = OpenAIServingChat(tm, server_args.tool_call_parser, server_args.reasoning_parser)
    tokens = OpenAIServingTokenize(tm)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tm.start(asyncio.get_running_loop())
        yield
        # Every connection has ended and the loop is about to close: the scheduler's news of the
        # requests it still runs until the shutdown reaches it has nowhere to go.
        tm.client.stop_delivery()

    app = FastAPI(title="sglang", lifespan=lifespan, default_response_class=JSONBody)
    install_error_handlers(app)

    if server_args.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=server_args.api_key)

    # ------------------------------------------------------------------ health and info
    @app.get("/health")
    async def health() -> Response:
        if tm.is_healthy():
            return Response(status_code=200)
        return error_response(tm.dead_reason or "the scheduler is not running", 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if not tm.is_healthy():
            return error_response(tm.dead_reason or "the scheduler is not running", 503)
        # A probe, not traffic: kept out of /metrics' request counts (as upstream's).
        obj = GenerateReqInput(input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0.0},
                               log_metrics=False)
        try:
            result = await asyncio.wait_for(tm.generate_one(obj), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            return error_response("generation did not finish in time", 503)
        except InvalidRequestError as e:  # the probe asks nothing a server could refuse: its own fault
            return error_response(f"the server cannot run a one-token request: {e}", 503)
        err = _abort_error(result)
        return err if err is not None else Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": sglang.__version__}  # as SGLang's and vLLM's /version

    @app.get("/get_model_info")
    async def get_model_info() -> dict:
        return tm.model_info()

    @app.get("/get_server_info")
    async def get_server_info() -> dict:
        return await tm.server_info()

    if tm.metrics is not None:
        from prometheus_client import CONTENT_TYPE_LATEST

        @app.get("/metrics")
        async def metrics() -> Response:
            # The scheduler-side series are read now (managers/metrics.py): one message per scrape.
            return Response(tm.metrics.render(await tm.get_scheduler_info()), media_type=CONTENT_TYPE_LATEST)

    def model_cards() -> list[ModelCard]:
        cards = [ModelCard(id=tm.served_model_name, root=tm.config.model_path, max_model_len=tm.context_len)]
        if tm.lora_registry is not None:
            for name, ref in sorted(tm.lora_registry.get_all().items()):
                cards.append(ModelCard(id=name, root=ref.lora_path, parent=tm.served_model_name))
        return cards

    @app.get("/v1/models")
    async def models() -> dict:
        return ModelList(data=model_cards()).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        """One model card (the OpenAI client's `models.retrieve`); adapter names may hold '/'."""
        card = next((c for c in model_cards() if c.id == model_id), None)
        if card is None:
            raise ModelNotFoundError(model_id, f"This server serves `{tm.served_model_name}`.")
        return card.model_dump()

    # ------------------------------------------------------------------ generation
    @app.post("/generate")
    async def generate(request: Request) -> Response:
        obj = GenerateReqInput.from_json(await _json_body(request))
        if obj.stream:
            _, outs = await prime(tm.generate(obj, request))

            async def events() -> AsyncIterator[str]:
                async for out in outs:
                    failure = server_failure(out)
                    if failure is not None:  # failed mid-stream: the 200 is sent, so an error event
                        yield sse_error(failure.message, failure.status_code)
                        continue
                    yield sse(out)

            return streaming_response(events(), outs)
        result = await tm.generate_one(obj, request)
        return _abort_error(result) or JSONBody(result)

    # The OpenAI routes parse the body themselves: any Content-Type is accepted (curl -d sends a
    # form type), and malformed JSON and wrong types get the same readable 400.
    @app.post("/v1/completions")
    async def v1_completions(request: Request) -> Response:
        return await completions.handle(_validate(CompletionRequest, await _json_body(request)), request)

    @app.post("/v1/chat/completions")
    async def v1_chat(request: Request) -> Response:
        return await chat.handle(_validate(ChatCompletionRequest, await _json_body(request)), request)

    async def tokenize(request: Request) -> Response:
        return JSONBody(await tokens.tokenize(_validate(TokenizeRequest, await _json_body(request))))

    async def detokenize(request: Request) -> Response:
        return JSONBody(tokens.detokenize(_validate(DetokenizeRequest, await _json_body(request))))

    # SGLang serves these without the /v1 prefix, vLLM with it (and without): accept both.
    for prefix in ("", "/v1"):
        app.add_api_route(f"{prefix}/tokenize", tokenize, methods=["POST"])
        app.add_api_route(f"{prefix}/detokenize", detokenize, methods=["POST"])

    # ------------------------------------------------------------------ adapters
    async def lora_request_body(request: Request, fields: set[str]) -> Any:
        """The JSON object of an adapter request, or the refusal to send instead."""
        try:
            data = await _json_body(request)
        except InvalidRequestError as e:
            return tm.lora_refusal(e.message, 400)
        if not isinstance(data, dict):
            return tm.lora_refusal("the request body must be a JSON object", 400)
        unknown = sorted(set(data) - fields)
        if unknown:
            return tm.lora_refusal(f"unknown field(s) {unknown}; expected {sorted(fields)}", 400)
        return data

    async def load_lora_adapter(request: Request) -> Response:
        data = await lora_request_body(request, {"lora_name", "lora_path", "pinned"})
        if isinstance(data, tuple):
            return _lora_update_response(*data)
        out, status = await tm.load_lora_adapter(data.get("lora_name"), data.get("lora_path"),
                                                 data.get("pinned", False))
        return _lora_update_response(out, status)

    async def unload_lora_adapter(request: Request) -> Response:
        data = await lora_request_body(request, {"lora_name"})
        if isinstance(data, tuple):
            return _lora_update_response(*data)
        out, status = await tm.unload_lora_adapter(data.get("lora_name"))
        return _lora_update_response(out, status)

    # SGLang serves these without the /v1 prefix, vLLM with it: accept both.
    for prefix in ("", "/v1"):
        app.add_api_route(f"{prefix}/load_lora_adapter", load_lora_adapter, methods=["POST"])
        app.add_api_route(f"{prefix}/unload_lora_adapter", unload_lora_adapter, methods=["POST"])

    async def json_object(request: Request) -> dict:
        data = await _json_body(request)
        if not isinstance(data, dict):
            raise InvalidRequestError(f"the request body must be a JSON object, got {type(data).__name__}")
        return data

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        """Empty the prefix cache; a 400 with the reason while requests run."""
        out = await tm.flush_cache()
        body: dict[str, Any] = {"success": out.success, "message": out.message}
        if not out.success:
            body.update(error_body(out.message, 400))
        return JSONBody(body, status_code=200 if out.success else 400)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        data = await json_object(request)
        rid = data.get("rid")
        if not isinstance(rid, str) or not rid:
            raise InvalidRequestError("'rid' (a string) is required", param="rid")
        tm.abort(rid)
        return Response(status_code=200)

    if server_args.enable_test_hooks:
        @app.post("/debug/inject_fault")
        async def inject_fault(request: Request) -> Response:
            data = await json_object(request)
            sub, where, after = data.get("rid_substring"), data.get("where", "forward"), data.get("after_tokens", 0)
            tp_rank = data.get("tp_rank")
            if (not isinstance(sub, str) or not sub or not isinstance(where, str) or type(after) is not int
                    or (tp_rank is not None and type(tp_rank) is not int)):
                raise InvalidRequestError("'rid_substring' (a non-empty string) is required; 'where' is a string, "
                                          "'after_tokens' an integer and 'tp_rank' an integer or null",
                                          param="rid_substring")
            tm.inject_fault(sub, where, after, tp_rank)
            return Response(status_code=200)

    return app


def reserve_address(host: str, port: int) -> socket.socket:
    """host:port bound (not yet listening) before anything loads, for uvicorn to serve on once the
    model is ready: a host that does not resolve or a port another process holds fails now, not
    after minutes of loading, and a process that binds without SO_REUSEADDR cannot take the port
    in between (one that sets it can, as a second server on the port does: then whichever listens
    last fails, with the same message). Connections are refused until then, as upstream's."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r} does not resolve: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on --host {host} --port {port}: {e.strerror}") from None
    return sock


def launch_server(server_args: ServerArgs) -> None:
    """Start the scheduler, then serve HTTP until SIGINT/SIGTERM; always reaps the scheduler."""
    with reserve_address(server_args.host, server_args.port) as listener:
        _serve(server_args, listener)


def _serve(server_args: ServerArgs, listener: socket.socket) -> None:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, which also tells the tokenizer manager that the server is stopping."""

        signalled = False

        async def startup(self, sockets: Optional[list] = None) -> None:
            await super().startup(sockets)
            if self.started:  # listening: a client may connect from now on
                logger.info("The server is ready: http://%s:%d (model %s)", server_args.host, server_args.port,
                            tm.served_model_name)

        def handle_exit(self, sig: int, frame: Any) -> None:
            self.signalled = True
            if tm.loop is not None:
                tm.loop.call_soon_threadsafe(tm.begin_shutdown, server_args.shutdown_timeout)
            super().handle_exit(sig, frame)

    t0 = time.time()
    tm = launch_runtime(server_args)
    signalled = False
    try:
        app = create_app(tm, server_args)
        config = uvicorn.Config(
            app, host=server_args.host, port=server_args.port, log_level=server_args.log_level,
            # Longer than the grace the requests get: every reply ends before uvicorn cancels it.
            timeout_keep_alive=5, timeout_graceful_shutdown=server_args.shutdown_timeout + 1.5, lifespan="on",
        )
        server = Server(config)

        def on_scheduler_exit() -> None:
            server.should_exit = True  # nothing can be served any more; let a supervisor restart us

        tm.on_fatal = on_scheduler_exit
        # uvicorn handles SIGINT/SIGTERM while it runs and, once shut down, re-raises the signal
        # under the handlers that were installed before it: make those no-ops, so the re-raised
        # signal does not kill this process before the scheduler is reaped below.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        logger.info("Start-up took %.1f s; starting the HTTP server.", time.time() - t0)
        try:
            listener.listen(config.backlog)  # connections wait in the backlog until uvicorn serves them
        except OSError as e:  # another server reserved the port beside ours and listens already
            raise ValueError(f"cannot listen on --host {server_args.host} --port {server_args.port}: "
                             f"{e.strerror or e}") from None
        server.run(sockets=[listener])
        signalled = server.signalled
    finally:
        tm.client.shutdown()
        logger.info("The scheduler has exited; bye.")
    if tm.dead_reason is not None:
        if signalled:
            # A stop signal to the whole process group reaches the scheduler too: a normal stop.
            logger.info("The scheduler stopped on the same signal (%s).", tm.dead_reason)
            return
        raise SystemExit(f"The server stopped because {tm.dead_reason}.")
