"""How the app answers every error in OpenAI's shape, with a 4xx status when the input is at fault.

FastAPI's 422 validation errors become 400s, as OpenAI clients expect; HTTP errors of the
framework (404, 405) keep their status in OpenAI's shape; anything unexpected is a 500 whose
details stay in the server log. Errors answered before the app runs are middleware.py's.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.entrypoints.openai.errors import APIError, validation_error_message

logger = logging.getLogger("pagedllm.server")


class ErrorResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error message can quote input, and escaping can never fail
    to encode (Starlette's JSONResponse encodes UTF-8, which a stray surrogate breaks)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content).encode()


def install_error_handlers(app: FastAPI) -> None:
    """Registers the exception handlers that answer APIError, validation errors, HTTP errors and
    any other exception in OpenAI's shape."""

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
