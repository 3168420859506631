"""The OpenAI-compatible HTTP server: FastAPI app, middleware, routes, and ``run_server``.

Routes: /v1/models, /v1/completions, /v1/chat/completions, /tokenize, /detokenize (bearer auth
when an API key is set), /health, /version, /metrics (Prometheus), /stats (JSON engine stats),
/kv (a live view of the KV cache) and /kv/blocks (its data: kv_view.py).

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
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagedllm
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.client import EngineClient
from pagedllm.engine.request_stream import EngineDeadError
from pagedllm.entrypoints.openai.errors import APIError, validation_error_message
from pagedllm.entrypoints.openai.kv_view import add_kv_view_routes
from pagedllm.entrypoints.openai.limits import ServerLimits
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagedllm.entrypoints.openai.tool_parsers import tool_parser
from pagedllm.host_memory import release_freed_heap
from pagedllm.metrics import ServerMetrics
from pagedllm.tokenizer import load_tokenizer, shareable_across_threads

logger = logging.getLogger("pagedllm.server")

DEFAULT_MAX_BODY_BYTES = 8 * 2**20
_BODY_METHODS = {"POST", "PUT", "PATCH"}


class ErrorResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error message can quote input, and escaping can never fail
    to encode (Starlette's JSONResponse encodes UTF-8, which a stray surrogate breaks)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content).encode()


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


# Routes any client may call without a key: load balancers and orchestrators probe /health; the
# /kv page is static and holds no data (its script reads /kv/blocks with the key).
PUBLIC_PATHS = frozenset({"/health", "/kv"})
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


class AuthMiddleware:
    """Bearer-token check on every route but PUBLIC_PATHS (and /metrics unless ``metrics_require_key``),
    before the body is read (so 401 beats 400/413). Any of several keys is accepted."""

    def __init__(self, app: Any, api_keys: list[str], metrics_require_key: bool = False) -> None:
        self.app = app
        self.expected = [f"Bearer {k}".encode() for k in api_keys]
        self.public = PUBLIC_PATHS if metrics_require_key else PUBLIC_PATHS | {"/metrics"}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in self.public:
            got = dict(scope["headers"]).get(b"authorization", b"")
            # Every key is compared (no early exit): the time taken says nothing about which matched.
            ok = [secrets.compare_digest(got, e) for e in self.expected]
            if not any(ok):
                err = APIError(
                    "Missing or incorrect API key: send 'Authorization: Bearer <key>'.",
                    401,
                    code="invalid_api_key",
                )
                await _send_json(send, 401, err.to_dict())
                return
        await self.app(scope, receive, send)


class AllowedHostsMiddleware:
    """400 unless the Host header names an allowed host: a page on another site cannot reach a
    loopback server through DNS rebinding (its requests carry the attacker's host name)."""

    def __init__(self, app: Any, allowed_hosts: list[str]) -> None:
        self.app = app
        self.allowed = {h.lower().strip("[]") for h in allowed_hosts}

    @staticmethod
    def _hostname(host: str) -> str:
        if host.startswith("["):  # [::1]:8000
            return host[1 : host.find("]")] if "]" in host else host
        return host.rsplit(":", 1)[0] if host.count(":") == 1 else host

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            if self._hostname(host).lower() not in self.allowed:
                err = APIError("Invalid Host header.", 400, code="invalid_host")
                await _send_json(send, 400, err.to_dict())
                return
        await self.app(scope, receive, send)


def parse_api_keys(values: list[str] | str | None) -> list[str]:
    """Keys from repeated and/or comma-separated values; empty entries dropped."""
    if values is None:
        return []
    if isinstance(values, str):
        values = [values]
    return [k.strip() for v in values for k in v.split(",") if k.strip()]


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


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorBody(BaseModel):
    """OpenAI's error shape, which every error response of this server has."""

    error: ErrorDetail


# ---- 200 bodies, for the OpenAPI document only (the routes build plain dicts) -------------------
# What a client generator or a fuzzer checks a response against (tests/test_openapi_fuzz.py runs
# Schemathesis' response_schema_conformance on them). Logprobs stay free-form objects: their shape
# follows OpenAI's and vLLM's, which differ by endpoint.
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length", "abort"] | None
    stop_reason: int | str | None
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # only when the request asks for them


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length", "abort"] | None
    stop_reason: int | str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # only when the request asks for them


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(BaseModel):
    prompt: str


def _generation_ok(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    return {
        200: {
            "model": model,
            "description": 'The completion; with `"stream": true`, server-sent events of chunks ending in `[DONE]`.',
            "content": {"text/event-stream": {}},
        }
    }


def _err(description: str) -> dict:
    return {"model": ErrorBody, "description": description}


_AUTH_ERRORS: dict[int | str, dict[str, Any]] = {401: _err("Missing or incorrect API key (when the server has one).")}
_ENGINE_ERRORS: dict[int | str, dict[str, Any]] = {503: _err("The engine is not running.")}
_REQUEST_ERRORS: dict[int | str, dict[str, Any]] = {
    400: _err("Invalid request: the message names the field (`param`)."),
    **_AUTH_ERRORS,
    404: _err("Unknown model."),
    413: _err("Request body too large."),
    500: _err("The engine failed on this request (details in the server log)."),
    **_ENGINE_ERRORS,
}


def _openapi_without_422(app: FastAPI) -> dict:
    """FastAPI documents its validation errors as 422 with its own shape; this server answers them
    as 400 in OpenAI's shape (documented per route), so the 422s go."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for ops in schema.get("paths", {}).values():
            for op in ops.values():
                op.get("responses", {}).pop("422", None)
        schemas = schema.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


def build_app(
    engine: EngineClient,
    served_model_names: list[str],
    metrics: ServerMetrics | None = None,
    api_key: str | list[str] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    limits: ServerLimits | None = None,
    metrics_require_key: bool = False,
    allowed_hosts: list[str] | None = None,
    show_model_path: bool = False,
    tool_call_parser: str | None = None,
    enable_auto_tool_choice: bool = False,
) -> FastAPI:
    """The FastAPI app around a (not yet started) engine client (an AsyncLLMEngine, or the
    data-parallel replicas' client); the app's lifespan runs the engine.

    ``show_model_path``: /v1/models gives the model's folder as ``root`` (by default the served
    name: a local path tells clients about the server's file system). ``tool_call_parser`` /
    ``enable_auto_tool_choice``: how tool_choice "auto" reads calls from the model's text
    (tool_parsers.py)."""
    facts = engine.facts
    metrics = metrics or ServerMetrics(served_model_names[0], max_model_len=facts.max_model_len)
    if not metrics.cache_config:
        metrics.cache_config = dict(facts.cache_config)
    if engine.output_hook is None:  # latencies and token counts per output (run_server sets it first)
        engine.output_hook = metrics.observe_output
    tok_path = facts.tokenizer_path
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-tokenizer")
    # One tokenizer for the engine thread, the tokenizer pool and the event loop where that is safe
    # (each instance holds ~10 MB); else the pool and the event loop get their own.
    tok = engine.tokenizer
    if tok is None:
        raise ValueError("The server needs the tokenizer: skip_tokenizer_init is for the offline LLM only.")
    if shareable_across_threads(tok):
        encode_tok = decode_tok = tok
    else:
        encode_tok, decode_tok = load_tokenizer(tok_path), load_tokenizer(tok_path)
        # the engine argument chat_template replaced the engine tokenizer's: the same here
        encode_tok.chat_template = decode_tok.chat_template = tok.chat_template
    serving_args = (engine, served_model_names, encode_tok, decode_tok, pool, limits)
    completions = OpenAIServingCompletion(*serving_args)
    chat = OpenAIServingChat(*serving_args)
    chat.tool_parser = tool_parser(tool_call_parser) if tool_call_parser else None
    chat.enable_auto_tools = enable_auto_tool_choice
    tokenization = OpenAIServingTokenization(chat)
    completions.on_request_params = chat.on_request_params = metrics.observe_params
    model_root = facts.model_path if show_model_path else served_model_names[0]
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

    app.openapi = lambda: _openapi_without_422(app)  # type: ignore[method-assign]

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return ErrorResponse(exc.to_dict(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_error_message(list(exc.errors()))
        return ErrorResponse(APIError(message, 400, param=param).to_dict(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return ErrorResponse(
            APIError(str(exc.detail), exc.status_code).to_dict(),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception) -> JSONResponse:
        # The exception's text is ours, not the client's business (and may quote other requests): log only.
        logger.exception("unhandled error on %s", request.url.path)
        return ErrorResponse(APIError("Internal server error.", 500).to_dict(), status_code=500)

    async def engine_stats() -> dict:
        try:
            return await engine.get_stats()
        except EngineDeadError as e:
            raise APIError("The engine is not running.", 503) from e

    @app.get(
        "/health",
        response_class=Response,
        responses={
            200: {"description": "The engine is running (empty body).", "content": {}},
            503: {"model": ErrorBody, "description": "The engine is not running, or its steps keep failing."},
        },
    )
    async def health() -> Response:
        problem = await engine.health_problem()
        if problem is not None:
            return ErrorResponse(APIError(problem, 503).to_dict(), status_code=503)
        return Response(status_code=200)

    @app.get("/version", responses=_AUTH_ERRORS)
    async def version() -> dict:
        return {"version": pagedllm.__version__}

    @app.get("/stats", responses={**_AUTH_ERRORS, **_ENGINE_ERRORS})
    async def stats() -> dict:
        return await engine_stats()  # with the step-failure counters (per replica under data parallelism)

    async def kv_blocks(replica: int | None) -> dict:
        try:
            return await engine.get_kv_blocks(replica)
        except ValueError as e:  # no such replica
            raise APIError(str(e), 400, param="replica") from e
        except EngineDeadError as e:
            raise APIError("The engine is not running.", 503) from e

    add_kv_view_routes(app, kv_blocks, {400: _err("No such data-parallel replica."), **_AUTH_ERRORS, **_ENGINE_ERRORS})

    @app.get(
        "/metrics",
        response_class=Response,
        responses={
            200: {"description": "Prometheus text exposition.", "content": {CONTENT_TYPE_LATEST: {}}},
            **_AUTH_ERRORS,
            **_ENGINE_ERRORS,
        },
    )
    async def prometheus_metrics() -> Response:
        stats = await engine_stats()
        if "replicas" in stats:  # data parallel: one series per replica
            metrics.update_replica_stats(stats["replicas"])
        else:
            metrics.update_engine_stats(stats)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses=_AUTH_ERRORS)
    async def models() -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": started,
                    "owned_by": "pagedllm",
                    "root": model_root,
                    "parent": None,
                    "max_model_len": facts.max_model_len,
                }
                for name in served_model_names
            ],
        }

    @app.post("/v1/completions", responses={**_generation_ok(CompletionResponse), **_REQUEST_ERRORS})
    async def create_completion(body: CompletionRequest, raw_request: Request) -> Response:
        return await completions.create_completion(body, raw_request)

    @app.post("/v1/chat/completions", responses={**_generation_ok(ChatCompletionResponse), **_REQUEST_ERRORS})
    async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request) -> Response:
        return await chat.create_chat_completion(body, raw_request)

    @app.post("/tokenize", responses={200: {"model": TokenizeResponse}, **_REQUEST_ERRORS})
    async def tokenize(body: TokenizeRequest) -> dict:
        return await tokenization.tokenize(body)

    @app.post("/detokenize", responses={200: {"model": DetokenizeResponse}, **_REQUEST_ERRORS})
    async def detokenize(body: DetokenizeRequest) -> dict:
        return await tokenization.detokenize(body)

    # Outermost first: auth, then the body limit (an unauthenticated client never makes us buffer).
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    keys = parse_api_keys(api_key)
    if keys:
        app.add_middleware(AuthMiddleware, api_keys=keys, metrics_require_key=metrics_require_key)
    if allowed_hosts and "*" not in allowed_hosts:
        app.add_middleware(AllowedHostsMiddleware, allowed_hosts=allowed_hosts)
    return app


def run_server(args: argparse.Namespace) -> int:
    """Loads the model, then serves until interrupted. Called by ``pagedllm serve``."""
    import uvicorn

    from pagedllm.config import EngineConfig
    from pagedllm.entrypoints.engine_args import engine_kwargs

    if args.model_tag:
        args.model = args.model_tag
    names = args.served_model_name or [args.model]
    api_keys = parse_api_keys(args.api_key or os.environ.get("PAGEDLLM_API_KEY"))
    loopback = args.host in LOOPBACK_HOSTS
    allowed_hosts = args.allowed_hosts
    if allowed_hosts is None and loopback and not api_keys:
        # Nothing else guards a keyless loopback server from a browser page's DNS rebinding.
        allowed_hosts = [*LOOPBACK_HOSTS, args.host]
    config = EngineConfig.from_kwargs(**engine_kwargs(args))
    engine: EngineClient
    if args.data_parallel_size != 1:
        from pagedllm.data_parallel.client import DataParallelClient

        engine = DataParallelClient.launch(
            config, args.data_parallel_size, args.data_parallel_routing, args.max_step_failures
        )
    else:  # one engine in this process: no Ray in the way
        engine = AsyncLLMEngine.from_config(config)
        engine.max_step_failures = args.max_step_failures
    # Built after the engine: its token-count histograms' buckets end at the model's context.
    metrics = ServerMetrics(names[0], prefix=args.metrics_prefix, max_model_len=engine.facts.max_model_len)
    engine.output_hook = metrics.observe_output
    limits = ServerLimits(
        max_prompts_per_request=args.max_prompts_per_request,
        max_seqs_per_request=args.max_seqs_per_request,
        max_stop_strings=args.max_stop_strings,
        max_stop_string_chars=args.max_stop_string_chars,
        max_stop_token_ids=args.max_stop_token_ids,
        max_messages=args.max_messages,
        max_request_tokens=args.max_request_tokens,
    )
    app = build_app(
        engine,
        names,
        metrics,
        api_keys,
        args.max_request_body_bytes,
        limits,
        metrics_require_key=args.metrics_require_key,
        allowed_hosts=allowed_hosts,
        show_model_path=args.show_model_path,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
    )
    if not loopback:
        logger.warning(
            "listening on %s: reachable from other machines%s",
            args.host,
            "" if api_keys else " without an API key",
        )
    logger.info("serving %s on http://%s:%d/v1", ", ".join(names), args.host, args.port)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
            timeout_graceful_shutdown=5,
        )
    )
    died: list[BaseException] = []

    def on_dead(error: BaseException) -> None:
        # A server whose engine is gone would answer 503 forever: exit so a supervisor restarts it.
        died.append(error)
        logger.critical("the engine thread died; shutting the server down")
        server.should_exit = True

    engine.on_dead = on_dead
    if engine.facts.device_type == "cpu":
        release_freed_heap()  # what building the app left behind; the engine trimmed its own load
    server.run()
    return 1 if died else 0
