"""Streaming pieces shared by /v1/completions and /v1/chat/completions.

SSE framing (``sse``, ``chunk_writer``), merging several prompts' request streams as outputs
arrive, a StreamingResponse that aborts its requests however it ends, waiting for the client to
disconnect, and the per-choice state of a streamed response.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedllm.engine.client import OutputStream
from pagedllm.outputs import RequestOutput

# Characters JSON leaves unescaped that Python's str.splitlines() (and so httpx's aiter_lines,
# which many SSE clients read with) takes for line ends: a token holding one split its event's
# JSON in two for such a client (2 of 15,823 streams of the 60-minute soak). SSE itself ends lines
# at CR / LF only; escaped, the JSON is the same and every line reader sees one line.
_LINE_BREAKS_JSON_KEEPS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(data: dict | str) -> str:
    """One server-sent event; compact JSON since a stream sends one event per token or so."""
    if not isinstance(data, str):
        data = json.dumps(data, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS_JSON_KEEPS)
    return f"data: {data}\n\n"


def chunk_writer(request_id: str, obj: str, created: int, model: str) -> Callable[..., str]:
    """SSE writer for one streamed response: every chunk repeats the response's id/object/model."""

    def chunk(choices: list[dict], **extra: Any) -> str:
        return sse({"id": request_id, "object": obj, "created": created, "model": model, "choices": choices, **extra})

    return chunk


class ClientDisconnected(Exception):
    pass


class AbortOnCloseStreamingResponse(StreamingResponse):
    """A StreamingResponse that aborts its requests however the response ends.

    The body generator's own ``finally`` covers cancellation while it runs; this also covers a
    client that vanishes before the generator ever started (then its finally would never run).
    """

    def __init__(self, content: AsyncIterator[str], streams: list[OutputStream]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._streams = streams

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            abort_all(self._streams)


def abort_all(streams: list[OutputStream]) -> None:
    for s in streams:
        s.abort()


async def merge_streams(streams: list[OutputStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yields (prompt index, output) from several request streams as outputs arrive.

    Like RequestStream itself, keeps only the latest unread output per stream (outputs are
    cumulative), so a slow client costs no memory however many prompts it sent.
    """
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    latest: dict[int, RequestOutput] = {}
    errors: list[Exception] = []
    event = asyncio.Event()
    running = len(streams)

    async def pump(i: int, s: OutputStream) -> None:
        nonlocal running
        try:
            async for out in s:
                latest[i] = out
                event.set()
        except Exception as e:
            errors.append(e)
        finally:
            running -= 1
            event.set()

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        while True:
            if latest:
                i = next(iter(latest))
                yield i, latest.pop(i)
                continue
            if errors:
                raise errors[0]
            if running == 0:
                return
            event.clear()
            await event.wait()
    finally:
        for t in tasks:
            t.cancel()


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (ASGI http.disconnect), without polling."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


@dataclass
class _ChoiceState:
    text_len: int = 0  # characters already sent
    num_tokens: int = 0  # tokens already sent (their logprobs too)
    text_offset: int = 0  # completions logprobs: offset of the next token in the choice's text
    sent_prompt_logprobs: bool = False  # completions: vLLM's prompt_logprobs go in a choice's first chunk
    started: bool = False  # echo / chat role already sent
    finished: bool = False
