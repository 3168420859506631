"""Anthropic's Messages API: POST /v1/messages and POST /v1/messages/count_tokens.

A Messages request is translated into a chat completion request (anthropic_convert.py) and runs
the chat path (OpenAIServingChat.prepare: template, tools, constraints, sampling, caps); the
answer is Anthropic's message, or its events when streamed (anthropic_streaming.py). Errors are
Anthropic's shape (anthropic_errors.py). Authentication is the server's API key, sent as
``x-api-key`` (Anthropic's clients) or as a Bearer token (middleware.py).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response

from pagedllm.entrypoints.openai.anthropic_convert import finished_turn, messages_usage, to_chat_request
from pagedllm.entrypoints.openai.anthropic_errors import AnthropicRoute, anthropic_error_response
from pagedllm.entrypoints.openai.anthropic_protocol import (
    AnthropicErrorBody,
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
)
from pagedllm.entrypoints.openai.anthropic_streaming import message_events
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.streaming import AbortOnCloseStreamingResponse, ClientDisconnected


class ServingMessages:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create_message(self, req: MessagesRequest, raw_request: Request) -> Response:
        arrival = time.monotonic()
        translation = to_chat_request(req, self.chat.reasoning_parser is not None)
        prep = await self.chat.prepare(translation.request, continue_final_message=translation.continue_final_message)
        message_id = f"msg_{uuid.uuid4().hex}"
        streams = await self.chat.add_requests(message_id, [prep.prompt], prep.params, arrival, prep.constraint_field)
        if req.stream:
            events = message_events(self.chat, message_id, streams, prep, translation)
            return AbortOnCloseStreamingResponse(events, streams)
        try:
            (out,) = await self.chat.collect(streams, raw_request)
        except ClientDisconnected:
            return anthropic_error_response(APIError("Client disconnected.", 499))
        c = out.outputs[0]
        parts = self.chat.split(c.text)
        turn = finished_turn(prep.plan, parts.content, c.finish_reason, c.stop_reason, translation.parallel_tool_calls)
        turn.thinking = parts.reasoning
        body = {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "content": turn.content(),
            "model": prep.model,
            "stop_reason": turn.stop_reason,
            "stop_sequence": turn.stop_sequence,
            "usage": messages_usage(len(out.prompt_token_ids), out.num_cached_tokens, len(c.token_ids)),
        }
        return await self.chat.json_response(lambda: body)

    async def count_tokens(self, req: CountTokensRequest) -> dict:
        """The prompt's tokens as /v1/messages would render them, through the same checks."""
        translation = to_chat_request(req, self.chat.reasoning_parser is not None)
        prep = await self.chat.prepare(translation.request, continue_final_message=translation.continue_final_message)
        return {"input_tokens": len(prep.prompt["prompt_token_ids"])}


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    described = {
        400: "Invalid request: the message names the field.",
        401: "Missing or incorrect API key (x-api-key, or a Bearer token).",
        404: "Unknown model.",
        413: "Request body too large.",
        500: "The engine failed on this request (details in the server log).",
        503: "The engine is not running.",
    }
    return {s: {"model": AnthropicErrorBody, "description": described[s]} for s in statuses}


def add_messages_routes(app: FastAPI, chat: OpenAIServingChat) -> None:
    """Adds /v1/messages and /v1/messages/count_tokens, answering errors in Anthropic's shape."""
    messages = ServingMessages(chat)
    router = APIRouter(route_class=AnthropicRoute)

    @router.post(
        "/v1/messages",
        responses={
            200: {
                "model": MessageResponse,
                "description": 'The message; with `"stream": true`, Anthropic\'s server-sent events.',
                "content": {"text/event-stream": {}},
            },
            **_errors(400, 401, 404, 413, 500, 503),
        },
    )
    async def create_message(body: MessagesRequest, raw_request: Request) -> Response:
        return await messages.create_message(body, raw_request)

    @router.post(
        "/v1/messages/count_tokens",
        responses={200: {"model": CountTokensResponse}, **_errors(400, 401, 404, 413)},
    )
    async def count_tokens(body: CountTokensRequest) -> dict:
        return await messages.count_tokens(body)

    app.include_router(router)
