"""The OpenAI-compatible HTTP server: the FastAPI app with its routes (``build_app``), and ``run_server``.

Routes: /v1/models, /v1/completions, /v1/chat/completions, /v1/responses (serving_responses.py),
Anthropic's /v1/messages and /v1/messages/count_tokens (serving_messages.py), /tokenize,
/detokenize (the API key, when one is set, as a Bearer token or x-api-key), /health, /version,
/metrics (Prometheus), /stats (JSON engine stats), /kv (a live view of the KV cache) and
/kv/blocks (its data: kv_view.py).

Every error is answered in OpenAI's shape with a 4xx status when the input is at fault
(error_handlers.py; middleware.py for API keys, Host headers and body sizes); FastAPI's 422
validation errors become 400s, as OpenAI clients expect. What the OpenAPI document says of the
responses is openapi_docs.py.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

import pagedllm
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.client import EngineClient
from pagedllm.engine.request_stream import EngineDeadError
from pagedllm.entrypoints.openai.error_handlers import ErrorResponse, install_error_handlers
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.kv_view import add_kv_view_routes
from pagedllm.entrypoints.openai.limits import DEFAULT_MAX_BODY_BYTES, ServerLimits
from pagedllm.entrypoints.openai.middleware import (
    AllowedHostsMiddleware,
    AuthMiddleware,
    BodyLimitMiddleware,
    parse_api_keys,
)
from pagedllm.entrypoints.openai.openapi_docs import (
    AUTH_ERRORS,
    ENGINE_ERRORS,
    REQUEST_ERRORS,
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ErrorBody,
    TokenizeResponse,
    error_doc,
    generation_ok,
    openapi_without_422,
)
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagedllm.entrypoints.openai.reasoning_parsers import reasoning_parser as make_reasoning_parser
from pagedllm.entrypoints.openai.response_store import DEFAULT_STORE_SIZE, ResponseStore
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_messages import add_messages_routes
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses, add_responses_routes
from pagedllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagedllm.entrypoints.openai.tool_parsers import tool_parser
from pagedllm.host_memory import release_freed_heap
from pagedllm.metrics import ServerMetrics
from pagedllm.tokenizer import load_tokenizer, shareable_across_threads

logger = logging.getLogger("pagedllm.server")
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
TOKENIZER_THREADS = 4


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
    responses_store_size: int = DEFAULT_STORE_SIZE,
    reasoning_parser: str | None = None,
) -> FastAPI:
    """The FastAPI app around a (not yet started) engine client (an AsyncLLMEngine, or the
    data-parallel replicas' client); the app's lifespan runs the engine.

    ``show_model_path``: /v1/models gives the model's folder as ``root`` (by default the served
    name: a local path tells clients about the server's file system). ``tool_call_parser`` /
    ``enable_auto_tool_choice``: how tool_choice "auto" reads calls from the model's text
    (tool_parsers/). ``responses_store_size``: responses /v1/responses keeps (response_store.py).
    ``reasoning_parser``: which part of the output is reasoning (reasoning_parsers.py)."""
    facts = engine.facts
    metrics = metrics or ServerMetrics(served_model_names[0], max_model_len=facts.max_model_len)
    if not metrics.cache_config:
        metrics.cache_config = dict(facts.cache_config)
    if engine.output_hook is None:  # latencies and token counts per output (run_server sets it first)
        engine.output_hook = metrics.observe_output
    tok_path = facts.tokenizer_path
    # One tokenizer for the engine thread, the tokenizer pool and the event loop where that is safe
    # (each instance holds ~10 MB); else the pool and the event loop get their own.
    tok = engine.tokenizer
    if tok is None:
        raise ValueError("The server needs the tokenizer: skip_tokenizer_init is for the offline LLM only.")
    if shareable := shareable_across_threads(tok):
        encode_tok = decode_tok = tok
    else:
        encode_tok, decode_tok = load_tokenizer(tok_path), load_tokenizer(tok_path)
        # the engine argument chat_template replaced the engine tokenizer's: the same here
        encode_tok.chat_template = decode_tok.chat_template = tok.chat_template
    # A few threads, so that a short prompt need not queue behind a long one (a tokenizer that
    # threads may not share gets one); text that cannot fit is refused before it gets here.
    workers = TOKENIZER_THREADS if shareable else 1
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pagedllm-tokenizer")
    serving_args = (engine, served_model_names, encode_tok, decode_tok, pool, limits)
    completions = OpenAIServingCompletion(*serving_args)
    chat = OpenAIServingChat(*serving_args)
    chat.tool_parser = tool_parser(tool_call_parser) if tool_call_parser else None
    chat.enable_auto_tools = enable_auto_tool_choice
    chat.reasoning_parser = make_reasoning_parser(reasoning_parser) if reasoning_parser else None
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

    app.openapi = lambda: openapi_without_422(app)  # type: ignore[method-assign]

    install_error_handlers(app)

    async def engine_stats(snapshot: bool = False) -> dict:
        """The engine's stats; ``snapshot``: as it last published them (no query, see get_stats_snapshot)."""
        try:
            return await (engine.get_stats_snapshot() if snapshot else engine.get_stats())
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

    @app.get("/version", responses=AUTH_ERRORS)
    async def version() -> dict:
        return {"version": pagedllm.__version__}

    @app.get("/stats", responses={**AUTH_ERRORS, **ENGINE_ERRORS})
    async def stats() -> dict:
        return await engine_stats()  # with the step-failure counters (per replica under data parallelism)

    async def kv_blocks(replica: int | None) -> dict:
        try:
            return await engine.get_kv_blocks(replica)
        except ValueError as e:  # no such replica
            raise APIError(str(e), 400, param="replica") from e
        except EngineDeadError as e:
            raise APIError("The engine is not running.", 503) from e

    add_kv_view_routes(
        app, kv_blocks, {400: error_doc("No such data-parallel replica."), **AUTH_ERRORS, **ENGINE_ERRORS}
    )

    @app.get(
        "/metrics",
        response_class=Response,
        responses={
            200: {"description": "Prometheus text exposition.", "content": {CONTENT_TYPE_LATEST: {}}},
            **AUTH_ERRORS,
            **ENGINE_ERRORS,
        },
    )
    async def prometheus_metrics() -> Response:
        stats = await engine_stats(snapshot=True)  # a scrape never waits on the engine thread
        return Response(metrics.exposition(stats), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses=AUTH_ERRORS)
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

    @app.post("/v1/completions", responses={**generation_ok(CompletionResponse), **REQUEST_ERRORS})
    async def create_completion(body: CompletionRequest, raw_request: Request) -> Response:
        return await completions.create_completion(body, raw_request)

    @app.post("/v1/chat/completions", responses={**generation_ok(ChatCompletionResponse), **REQUEST_ERRORS})
    async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request) -> Response:
        return await chat.create_chat_completion(body, raw_request)

    add_responses_routes(app, OpenAIServingResponses(chat, ResponseStore(responses_store_size)))
    add_messages_routes(app, chat)

    @app.post("/tokenize", responses={200: {"model": TokenizeResponse}, **REQUEST_ERRORS})
    async def tokenize(body: TokenizeRequest) -> dict:
        return await tokenization.tokenize(body)

    @app.post("/detokenize", responses={200: {"model": DetokenizeResponse}, **REQUEST_ERRORS})
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
        max_logit_bias=args.max_logit_bias,
        max_chars_per_token=args.max_chars_per_token,
        max_prompt_response_bytes=args.max_prompt_response_bytes,
        max_constraint_choices=args.max_constraint_choices,
        max_constraint_bytes=args.max_constraint_bytes,
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
        responses_store_size=args.responses_store_size,
        reasoning_parser=args.reasoning_parser,
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
