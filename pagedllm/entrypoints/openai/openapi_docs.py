"""What the OpenAPI document says about responses: their bodies and each route's error statuses.

The routes build plain dicts; these pydantic models exist for the document only, which client
generators and tests/test_openapi_fuzz.py read. Kept apart from the routes (api_server.py) so
that the routes read as what they do, and the document's shapes sit in one place.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel


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
class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens taken from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


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


def generation_ok(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    return {
        200: {
            "model": model,
            "description": 'The completion; with `"stream": true`, server-sent events of chunks ending in `[DONE]`.',
            "content": {"text/event-stream": {}},
        }
    }


def error_doc(description: str) -> dict:
    return {"model": ErrorBody, "description": description}


AUTH_ERRORS: dict[int | str, dict[str, Any]] = {
    401: error_doc("Missing or incorrect API key (when the server has one).")
}
ENGINE_ERRORS: dict[int | str, dict[str, Any]] = {503: error_doc("The engine is not running.")}
REQUEST_ERRORS: dict[int | str, dict[str, Any]] = {
    400: error_doc("Invalid request: the message names the field (`param`)."),
    **AUTH_ERRORS,
    404: error_doc("Unknown model."),
    413: error_doc("Request body too large."),
    500: error_doc("The engine failed on this request (details in the server log)."),
    **ENGINE_ERRORS,
}


def openapi_without_422(app: FastAPI) -> dict:
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
