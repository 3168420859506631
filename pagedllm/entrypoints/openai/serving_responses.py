"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

A response runs as a chat completion (serving_chat.py's ``prepare``: chat template, tool plan,
structured outputs, sampling and the server's caps), translated in (responses_input.py) and out
(responses_output.py, responses_streaming.py). Stored responses (``store``, by default true as
OpenAI's) are kept in a bounded in-memory store (response_store.py) for retrieval and for
``previous_response_id``, which continues a stored response's conversation.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagedllm.engine.client import OutputStream
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.openapi_docs import AUTH_ERRORS, REQUEST_ERRORS, error_doc
from pagedllm.entrypoints.openai.response_store import ResponseStore
from pagedllm.entrypoints.openai.responses_input import chat_request, responses_params, text_format
from pagedllm.entrypoints.openai.responses_output import (
    ResponseShell,
    assistant_message,
    cached_tokens,
    output_items,
    status_of,
    usage,
)
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest, check_supported
from pagedllm.entrypoints.openai.responses_streaming import ResponseEvents, StreamedOutput
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.streaming import (
    AbortOnCloseStreamingResponse,
    ClientDisconnected,
    abort_all,
    merge_streams,
)
from pagedllm.entrypoints.openai.tool_calls import ToolPlan


def _not_found(response_id: str) -> APIError:
    return APIError(f"Response with id '{response_id}' not found.", 404, param="response_id", code="not_found")


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponseStore) -> None:
        self.chat = chat
        self.store = store

    async def create(self, req: ResponsesRequest, raw_request: Request) -> Response:
        arrival = time.monotonic()
        model = self.chat.check_model(req.model)
        check_supported(req, self.chat.reasoning_parser is not None)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            previous = self.store.get(req.previous_response_id)
            if previous is None:
                raise APIError(
                    f"Previous response with id '{req.previous_response_id}' not found.",
                    404,
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            history = previous.conversation
        conversation, chat_req = chat_request(req, history, self.chat.reasoning_parser is not None)
        shell = ResponseShell(req, model, text_format(req.text))
        with responses_params():
            prep = await self.chat.prepare(chat_req)
            # inside too: the engine's refusals name the request field the constraint came from
            streams = await self.chat.add_requests(shell.id, [prep.prompt], prep.params, arrival, prep.constraint_field)
        plan, n_prompt = prep.plan, len(prep.prompt["prompt_token_ids"])
        if req.stream:
            return AbortOnCloseStreamingResponse(self._stream(shell, streams, plan, n_prompt, conversation), streams)
        try:
            (out,) = await self.chat.collect(streams, raw_request)
        except ClientDisconnected:
            return JSONResponse(APIError("Client disconnected.", 499).to_dict(), status_code=499)
        c = out.outputs[0]
        status = status_of(c.finish_reason)
        parts = self.chat.split(c.text)
        items = output_items(plan, parts.content, status, parts.reasoning)
        body = shell.response(
            status,
            items,
            usage(n_prompt, len(c.token_ids), cached_tokens(out), self.chat.reasoning_tokens(c.text, c.token_ids)),
        )
        self._keep(req, body, conversation, items)
        return await self.chat.json_response(lambda: body)

    def _keep(
        self, req: ResponsesRequest, body: dict[str, Any], conversation: list[dict], items: list[dict[str, Any]]
    ) -> None:
        if req.store is not False:
            self.store.put(body["id"], body, [*conversation, assistant_message(items)])

    async def _stream(
        self,
        shell: ResponseShell,
        streams: list[OutputStream],
        plan: ToolPlan | None,
        n_prompt: int,
        conversation: list[dict[str, Any]],
    ) -> AsyncIterator[str]:
        events = ResponseEvents()
        output = StreamedOutput(events, plan)
        yield events("response.created", response=shell.response("in_progress", []))
        yield events("response.in_progress", response=shell.response("in_progress", []))
        try:
            async for _, out in merge_streams(streams):
                c = out.outputs[0]
                finished = c.finish_reason is not None
                parts = self.chat.split(c.text, finished)
                for event in output.reason(parts.reasoning or ""):
                    yield event
                for event in output.update(parts.content, finished):
                    yield event
                if not finished:
                    continue
                status = status_of(c.finish_reason)
                for event in output.finish(status):
                    yield event
                body = shell.response(
                    status,
                    output.items,
                    usage(
                        n_prompt, len(c.token_ids), cached_tokens(out), self.chat.reasoning_tokens(c.text, c.token_ids)
                    ),
                )
                self._keep(shell.req, body, conversation, output.items)
                yield events("response.completed" if status == "completed" else "response.incomplete", response=body)
                return
        except Exception as e:  # after the 200: an error event, never a cut stream
            error = self.chat.stream_failure(e)
            yield events("error", code=error.code, message=error.message, param=error.param)
        finally:
            abort_all(streams)

    def retrieve(self, response_id: str) -> dict[str, Any]:
        entry = self.store.get(response_id)
        if entry is None:
            raise _not_found(response_id)
        return entry.response

    def delete(self, response_id: str) -> dict[str, Any]:
        if not self.store.delete(response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}


def add_responses_routes(app: FastAPI, responses: OpenAIServingResponses) -> None:
    stored_errors = {404: error_doc("No stored response has this id."), **AUTH_ERRORS}

    @app.post(
        "/v1/responses",
        responses={
            200: {
                "description": 'The response; with `"stream": true`, server-sent events of its typed events.',
                "content": {"text/event-stream": {}},
            },
            **REQUEST_ERRORS,
        },
    )
    async def create_response(body: ResponsesRequest, raw_request: Request) -> Response:
        return await responses.create(body, raw_request)

    # One route for both methods: a 405 on this path then lists both in its Allow header.
    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"], responses=stored_errors)
    async def stored_response(response_id: str, request: Request) -> dict:
        """GET: the stored response; DELETE: removes it."""
        if request.method == "DELETE":
            return responses.delete(response_id)
        return responses.retrieve(response_id)
