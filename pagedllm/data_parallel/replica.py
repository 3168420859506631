"""EngineReplica: the body of one data-parallel replica's Ray actor, an AsyncLLMEngine in its own process.

Ray runs it as an async actor: every method runs on the actor's event loop, and the engine's own
thread steps the model, as in the single-engine server. ``generate`` is an async generator, which
Ray turns into a streaming generator: the front end reads each item as soon as it is yielded.

What ``generate`` yields, in order:
* first ``None`` once the engine accepted the request, or the exception that refused it
  (ValueError / TypeError / NotImplementedError / EngineDeadError, as AsyncLLMEngine.add_request
  raises them) as a value, so the front end re-raises the very same error, not a wrapped one;
* then the request's RequestOutputs (cumulative; the last has finished=True). The engine keeps
  only the latest unread output per request, so a slow reader gets fewer, fuller items;
* or, if the engine failed the request, the RequestFailedError / EngineDeadError as a value.

``abort`` ends a request's generator (its stream closes) and frees its KV blocks.
"""

from __future__ import annotations

import os

from pagedllm.config import EngineConfig
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.client import ModelFacts
from pagedllm.engine.intake import PromptType
from pagedllm.engine.request_stream import EngineDeadError, RequestFailedError, RequestStream
from pagedllm.sampling_params import SamplingParams

_REFUSALS = (ValueError, TypeError, NotImplementedError, EngineDeadError)


class EngineReplica:
    def __init__(self, config: EngineConfig, index: int, max_step_failures: int = 3) -> None:
        self.index = index
        self.engine = AsyncLLMEngine.from_config(config)
        self.engine.max_step_failures = max_step_failures
        # A replica whose engine thread died would refuse every request it is sent; ending the
        # process makes it an actor death, which the front end already routes around (as the
        # single-engine server exits when its engine thread dies).
        self.engine.on_dead = lambda error: os._exit(1)
        self.engine.start()
        self._streams: dict[str, RequestStream] = {}
        self._adding: set[str] = set()  # ids whose add_request is in progress
        self._aborted_while_adding: set[str] = set()

    def facts(self) -> ModelFacts:
        """The model facts (called first: it returns once the model is loaded)."""
        return self.engine.facts

    async def generate(
        self, request_id: str, prompt: PromptType, params: SamplingParams | None, arrival_time: float | None
    ):  # -> AsyncIterator[None | RequestOutput | BaseException]; Ray's streaming generator
        self._adding.add(request_id)
        try:
            stream = await self.engine.add_request(request_id, prompt, params, arrival_time)
        except _REFUSALS as e:
            yield e
            return
        finally:
            self._adding.discard(request_id)
        if request_id in self._aborted_while_adding:  # the client left while the engine took it
            self._aborted_while_adding.discard(request_id)
            stream.abort()
            return
        self._streams[request_id] = stream
        try:
            yield None
            async for out in stream:
                yield out
        except (RequestFailedError, EngineDeadError) as e:
            yield e
        finally:
            # Also when Ray cancels the generator: the request must not keep its blocks.
            self._streams.pop(request_id, None)
            stream.abort()

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.abort()  # ends its generator too
            elif rid in self._adding:
                self._aborted_while_adding.add(rid)
            # else: already ended (the engine would ignore the id)

    async def get_stats(self) -> dict:
        return {**await self.engine.get_stats(), "pid": os.getpid()}

    async def get_stats_snapshot(self) -> dict:
        return {**await self.engine.get_stats_snapshot(), "pid": os.getpid()}

    async def get_kv_blocks(self) -> dict:
        return await self.engine.get_kv_blocks()

    async def health_problem(self) -> str | None:
        return await self.engine.health_problem()

    def shutdown(self) -> None:
        self.engine.shutdown()
