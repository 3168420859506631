"""Anthropic's error shape for the Messages endpoints (/v1/messages, /v1/messages/count_tokens).

Anthropic's clients read ``{"type": "error", "error": {"type": "invalid_request_error", "message":
...}}``, the error type following the status. The serving code raises the same APIError as the
OpenAI endpoints; ``AnthropicRoute`` answers what its routes raise (validation errors included)
in this shape, and the middleware (middleware.py) answers its 401s and 413s on these paths in it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.entrypoints.openai.error_handlers import ErrorResponse
from pagedllm.entrypoints.openai.errors import APIError, validation_error_message

logger = logging.getLogger("pagedllm.server")

MESSAGES_PATH = "/v1/messages"

# Anthropic's error type for each status it documents; any other 4xx is an invalid request,
# any other 5xx an api_error.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}

# The OpenAI names the chat path's errors use (param) -> the Messages field they came from.
_FIELD_NAMES = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens"}


def is_messages_path(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")


def anthropic_error_body(err: APIError) -> dict:
    """``err`` in Anthropic's shape; the field at fault (``param``, in the Messages request's
    names) leads the message, as Anthropic's own messages do ("max_tokens: Field required")."""
    message = err.message
    if err.param:
        field = _FIELD_NAMES.get(err.param, err.param)
        if field not in message:
            message = f"{field}: {message}"
    return {"type": "error", "error": {"type": error_type(err.status_code), "message": message}}


def anthropic_error_response(err: APIError, headers: dict | None = None) -> Response:
    return ErrorResponse(anthropic_error_body(err), status_code=err.status_code, headers=headers)


class AnthropicRoute(APIRoute):
    """A route whose every error (body validation, APIError, HTTP errors, bugs) is answered in
    Anthropic's shape; the app's handlers (error_handlers.py) stay OpenAI's for the other routes."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def anthropic_errors(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as e:
                message, param = validation_error_message(list(e.errors()))
                return anthropic_error_response(APIError(message, 400, param=param))
            except APIError as e:
                return anthropic_error_response(e)
            except StarletteHTTPException as e:
                return anthropic_error_response(APIError(str(e.detail), e.status_code), getattr(e, "headers", None))
            except Exception:  # our bug: its text stays in the log
                logger.exception("unhandled error on %s", request.url.path)
                return anthropic_error_response(APIError("Internal server error.", 500))

        return anthropic_errors
