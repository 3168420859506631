"""The server's ASGI middleware: API keys, allowed Host headers and the request body's size.

Plain ASGI middleware, apart from the routes: each check runs before the body is read (a 401 beats
a 400 or 413, and an unauthenticated client never makes the server buffer) and answers in OpenAI's
error shape itself (Anthropic's on the Messages paths: anthropic_errors.py), outside the app's
exception handlers (error_handlers.py).
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from pagedllm.entrypoints.openai.anthropic_errors import anthropic_error_body, is_messages_path
from pagedllm.entrypoints.openai.errors import APIError

_BODY_METHODS = {"POST", "PUT", "PATCH"}


async def _send_error(send: Any, scope: Any, err: APIError) -> None:
    """``err`` in the error shape of the route asked for: Anthropic's on the Messages paths."""
    body = anthropic_error_body(err) if is_messages_path(scope.get("path", "")) else err.to_dict()
    await _send_json(send, err.status_code, body)


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


class AuthMiddleware:
    """API-key check on every route but PUBLIC_PATHS (and /metrics unless ``metrics_require_key``),
    before the body is read (so 401 beats 400/413). Any of several keys is accepted, sent as
    OpenAI's clients do (``Authorization: Bearer <key>``) or as Anthropic's (``x-api-key: <key>``)."""

    def __init__(self, app: Any, api_keys: list[str], metrics_require_key: bool = False) -> None:
        self.app = app
        self.expected = [f"Bearer {k}".encode() for k in api_keys]
        self.expected_x_api_key = [k.encode() for k in api_keys]
        self.public = PUBLIC_PATHS if metrics_require_key else PUBLIC_PATHS | {"/metrics"}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in self.public:
            headers = dict(scope["headers"])
            bearer, x_api_key = headers.get(b"authorization", b""), headers.get(b"x-api-key", b"")
            # Every key is compared (no early exit): the time taken says nothing about which matched.
            ok = [secrets.compare_digest(bearer, e) for e in self.expected]
            ok += [secrets.compare_digest(x_api_key, e) for e in self.expected_x_api_key]
            if not any(ok):
                err = APIError(
                    "Missing or incorrect API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'.",
                    401,
                    code="invalid_api_key",
                )
                await _send_error(send, scope, err)
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
                await _send_error(send, scope, err)
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

    def _error(self, size: int | None) -> APIError:
        got = f"{size} bytes" if size is not None else f"more than {self.max_bytes} bytes"
        return APIError(
            f"Request body too large: {got}; the limit is {self.max_bytes} bytes.",
            413,
            code="request_too_large",
        )

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
                await _send_error(send, scope, APIError("Invalid Content-Length header."))
                return
            if size > self.drain_cap:
                await _send_error(send, scope, self._error(size))
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
            await _send_error(send, scope, self._error(size if size is not None else total))
            return
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
