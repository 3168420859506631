"""The OpenAI-compatible HTTP server: FastAPI app, middleware, routes, and ``run_server``.

Routes: /v1/models, /v1/completions, /v1/chat/completions (bearer auth when an API key is set),
/health, /version, /metrics (Prometheus), /stats (JSON engine stats).

Every error is answered in OpenAI's shape with a 4xx status when the input is at fault; FastAPI's
422 validation errors become 400s, as OpenAI clients expect.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagedllm
from pagedllm.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pagedllm.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    validation_error_message,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.metrics import ServerMetrics
from pagedllm.tokenizer import load_tokenizer

logger = logging.getLogger("pagedllm.server")

DEFAULT_MAX_BODY_BYTES = 8 * 2**20
_BODY_METHODS = {"POST", "PUT", "PATCH"}


async def _send_json(send: Any, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


class AuthMiddleware:
    """Bearer-token check on every /v1 route, before the body is read (so 401 beats 400/413)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(got, self.expected):
                err = APIError(
                    "Missing or incorrect API key: send 'Authorization: Bearer <key>'.",
                    401,
                    code="invalid_api_key",
                )
                await _send_json(send, 401, err.to_dict())
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for a request body over ``max_bytes``, by Content-Length and by the bytes actually sent.

    The body is read here (so a chunked upload cannot slip past the header check) and replayed to
    the app; later receive() calls go to the server, so disconnects are still seen. An oversized
    body is drained up to a cap before answering so the client reads the 413 rather than a reset.
    """

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.drain_cap = 8 * max_bytes

    def _error(self, size: int | None) -> dict:
        got = f"{size} bytes" if size is not None else f"more than {self.max_bytes} bytes"
        return APIError(
            f"Request body too large: {got}; the limit is {self.max_bytes} bytes.",
            413,
            code="request_too_large",
        ).to_dict()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        size: int | None = None
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                await _send_json(send, 400, APIError("Invalid Content-Length header.").to_dict())
                return
            if size > self.drain_cap:
                await _send_json(send, 413, self._error(size))
                return
        chunks: list[bytes] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            total += len(body)
            if total <= self.max_bytes:
                chunks.append(body)
            elif total > self.drain_cap:
                break
            if not message.get("more_body", False):
                break
        if total > self.max_bytes:
            await _send_json(send, 413, self._error(size if size is not None else total))
            return
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def build_app(
    engine: AsyncLLMEngine,
    served_model_names: list[str],
    metrics: ServerMetrics | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """The FastAPI app around a (not yet started) AsyncLLMEngine; the app's lifespan runs the engine."""
    metrics = metrics or ServerMetrics(served_model_names[0])
    llm = engine.engine
    tok_path = llm.config.tokenizer or llm.model_path
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-tokenizer")
    serving_args = (engine, served_model_names, load_tokenizer(tok_path), load_tokenizer(tok_path), pool)
    completions = OpenAIServingCompletion(*serving_args)
    chat = OpenAIServingChat(*serving_args)
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()
            pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="pagedllm OpenAI-compatible server", version=pagedllm.__version__, lifespan=lifespan)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.to_dict(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_error_message(list(exc.errors()))
        return JSONResponse(APIError(message, 400, param=param).to_dict(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            APIError(str(exc.detail), exc.status_code).to_dict(),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return JSONResponse(
            APIError(f"Internal server error: {type(exc).__name__}: {exc}", 500).to_dict(), status_code=500
        )

    async def engine_stats() -> dict:
        try:
            return await engine.get_stats()
        except EngineDeadError as e:
            raise APIError(str(e), 503) from e

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return JSONResponse(APIError("The engine is not running.", 503).to_dict(), status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": pagedllm.__version__}

    @app.get("/stats")
    async def stats() -> dict:
        return {**await engine_stats(), "num_step_errors": engine.num_step_errors}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        metrics.update_engine_stats(await engine_stats())
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": started,
                    "owned_by": "pagedllm",
                    "root": llm.model_path,
                    "parent": None,
                    "max_model_len": llm.max_model_len,
                }
                for name in served_model_names
            ],
        }

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw_request: Request) -> Response:
        return await completions.create_completion(body, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request) -> Response:
        return await chat.create_chat_completion(body, raw_request)

    # Outermost first: auth, then the body limit (an unauthenticated client never makes us buffer).
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(AuthMiddleware, api_key=api_key)
    return app


def run_server(args: argparse.Namespace) -> int:
    """Loads the model, then serves until interrupted. Called by ``pagedllm serve``."""
    import uvicorn

    from pagedllm.config import EngineConfig
    from pagedllm.entrypoints.engine_args import engine_kwargs

    if args.model_tag:
        args.model = args.model_tag
    names = args.served_model_name or [args.model]
    api_key = args.api_key or os.environ.get("PAGEDLLM_API_KEY") or None
    metrics = ServerMetrics(names[0])
    engine = AsyncLLMEngine.from_config(
        EngineConfig.from_kwargs(**engine_kwargs(args)), metrics.observe_output
    )
    app = build_app(engine, names, metrics, api_key, args.max_request_body_bytes)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning(
            "listening on %s: reachable from other machines%s",
            args.host,
            "" if api_key else " without an API key",
        )
    logger.info("serving %s on http://%s:%d/v1", ", ".join(names), args.host, args.port)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        timeout_graceful_shutdown=5,
    )
    return 0
