"""RequestStream: one request's outputs as an async iterator, and the errors that end a stream.

Kept apart from the engine thread (async_engine.py) because this side lives on the event loop:
the engine thread only hands outputs over (``_put`` through ``loop.call_soon_threadsafe``), and
everything here runs in the consumer's loop. The errors are what any EngineClient's streams raise
(data_parallel/ raises them too), so they live with the stream rather than with one engine.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from pagedllm.outputs import RequestOutput

if TYPE_CHECKING:
    from pagedllm.engine.async_engine import AsyncLLMEngine


class EngineDeadError(RuntimeError):
    """The engine thread is not running (never started, shut down, or crashed)."""


class RequestFailedError(RuntimeError):
    """The engine raised while this request was in flight; the request was aborted."""


class RequestStream:
    """Async iterator over one request's RequestOutputs; the last one has finished=True.

    Outputs are cumulative (each holds all text and tokens so far), so an output the consumer has
    not read yet is simply replaced by the next one: a slow client gets fewer, larger updates and
    holds at most one pending output, however far behind it is.

    Iteration ends after the finished output, or at once after ``abort()``; it raises
    RequestFailedError / EngineDeadError if the engine failed the request.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, engine: AsyncLLMEngine) -> None:
        self.request_id = request_id
        self._loop = loop
        self._engine = engine
        self._latest: RequestOutput | None = None  # delivered, not yet read
        self._error: BaseException | None = None
        self._closed = False  # nothing more to read after what is pending
        self._event = asyncio.Event()
        self.finished = False  # no more outputs will come: finished, failed or aborted

    def _put(self, item: RequestOutput | BaseException) -> None:  # on the event loop
        if self._closed:
            return  # aborted by the consumer: late outputs are dropped
        if isinstance(item, BaseException):
            self._error = item
            self.finished = True
        else:
            self._latest = item
            self.finished = self.finished or item.finished
        self._event.set()

    def abort(self) -> None:
        """Stops the request (idempotent, non-blocking): its KV blocks are freed before the next step.

        Call it on the stream's event loop.
        """
        if not self.finished:
            self._engine.abort(self.request_id)
        self.finished = True
        self._closed = True
        self._latest = None
        self._event.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if self._latest is not None:
                out, self._latest = self._latest, None
                if out.finished:
                    self._closed = True
                return out
            if self._error is not None:
                err, self._error = self._error, None
                self._closed = True
                raise err
            if self._closed:
                raise StopAsyncIteration
            self._event.clear()
            await self._event.wait()
