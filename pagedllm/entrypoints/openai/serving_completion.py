"""/v1/completions, plus OpenAIServing: what completions and chat share.

Shared pieces: the model-name check, tokenization off the event loop, adding a request's prompts
to the engine all-or-nothing, merging their streams, aborting on client disconnect, logprob
formatting, and the SSE framing.

Choices are numbered ``prompt_index * n + output.index`` as in OpenAI, so n > 1 works unchanged
once the engine returns several CompletionOutputs per RequestOutput.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedllm.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestFailedError, RequestStream
from pagedllm.entrypoints.openai.protocol import (
    _FIELDS,
    APIError,
    CompletionRequest,
    error_from_value_error,
    to_sampling_params,
)
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm.server")

_LOGPROB_FLOOR = -9999.0  # JSON has no -inf; vLLM clamps the same way


def sse(data: dict | str) -> str:
    """One server-sent event; compact JSON since a stream sends one event per token or so."""
    if not isinstance(data, str):
        data = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
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

    def __init__(self, content: AsyncIterator[str], streams: list[RequestStream]) -> None:
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


def abort_all(streams: list[RequestStream]) -> None:
    for s in streams:
        s.abort()


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
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

    async def pump(i: int, s: RequestStream) -> None:
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
    started: bool = False  # echo / chat role already sent
    finished: bool = False


class OpenAIServing:
    """State and helpers common to the OpenAI endpoints."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        served_model_names: list[str],
        tokenizer: Any,
        decode_tokenizer: Any,
        tokenizer_pool: ThreadPoolExecutor,
    ) -> None:
        # Separate tokenizer instances: a HF fast tokenizer must not be used from two threads at once
        # (the engine thread decodes with its own; `tokenizer` runs on the one-thread pool;
        # `decode_tokenizer` decodes logprob tokens on the event loop).
        self.engine = engine
        self.served_model_names = served_model_names
        self.tokenizer = tokenizer
        self.decode_tokenizer = decode_tokenizer
        self.pool = tokenizer_pool
        self.max_model_len: int = engine.engine.max_model_len
        # No token covers more characters than the longest vocabulary entry (byte-level BPE entries
        # are at least as long as their text), so a text longer than this many characters per token
        # of context cannot fit: reject it before tokenizing, which for megabytes takes many seconds.
        longest = max((len(t) for t in tokenizer.get_vocab()), default=16)
        self.max_prompt_chars = 2 * max(longest, 1) * self.max_model_len

    def check_model(self, name: str | None) -> str:
        if name is None or name == "":
            return self.served_model_names[0]
        if name not in self.served_model_names:
            raise APIError(
                f"The model `{name}` does not exist. Served: {', '.join(self.served_model_names)}.",
                404,
                param="model",
                code="model_not_found",
            )
        return name

    async def in_tokenizer_thread(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """Tokenizer work off the event loop: a long prompt takes a while to encode."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args, **kwargs))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenizes (in the tokenizer thread); a text too long to fit any tokenization is a 400."""
        if len(text) > self.max_prompt_chars:
            raise APIError(
                f"The prompt is {len(text)} characters long: more than the {self.max_model_len} tokens "
                f"of this model's maximum context length could hold (at most {self.max_prompt_chars} "
                "characters).",
                code="context_length_exceeded",
            )
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one instance per server, lives as long
    def token_str(self, token_id: int) -> str:
        return self.decode_tokenizer.decode([token_id], skip_special_tokens=False)

    async def add_requests(
        self, request_id: str, prompts: list[dict], params: SamplingParams, arrival_time: float
    ) -> list[RequestStream]:
        """Adds one engine request per prompt, all or nothing; bad input becomes a 400."""
        streams: list[RequestStream] = []
        try:
            for i, p in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(await self.engine.add_request(rid, p, params, arrival_time))
        except BaseException as e:
            abort_all(streams)
            if isinstance(e, (ValueError, TypeError)):
                err = error_from_value_error(e, _FIELDS)
                if len(prompts) > 1 and err.param is None:
                    err.message = f"Prompt {len(streams)}: {err.message}"
                raise err from e
            if isinstance(e, NotImplementedError):
                raise APIError(str(e), 400) from e
            if isinstance(e, EngineDeadError):
                raise APIError(str(e), 503) from e
            raise
        return streams

    async def collect(self, streams: list[RequestStream], request: Request) -> list[RequestOutput]:
        """The final output of every stream; aborts them all if the client disconnects first."""

        async def run() -> list[RequestOutput]:
            finals: list[RequestOutput | None] = [None] * len(streams)
            async for i, out in merge_streams(streams):
                finals[i] = out
            if any(f is None or not f.finished for f in finals):
                raise ClientDisconnected  # aborted under us
            return finals  # type: ignore[return-value]

        task = asyncio.create_task(run())
        watcher = asyncio.create_task(wait_for_disconnect(request))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                try:
                    return task.result()
                except (RequestFailedError, EngineDeadError) as e:
                    raise APIError(str(e), 500) from e
            logger.info("client disconnected: aborting %s", ", ".join(s.request_id for s in streams))
            raise ClientDisconnected
        finally:
            watcher.cancel()
            task.cancel()
            abort_all(streams)

    def logprob(self, v: float) -> float:
        return max(v, _LOGPROB_FLOOR) if v == v else _LOGPROB_FLOOR  # NaN -> floor

    def top_entries(self, lp: dict[int, float], k: int) -> list[tuple[int, float]]:
        """The k most likely tokens of one position (the engine's dict also holds the chosen one)."""
        return sorted(lp.items(), key=lambda kv: -kv[1])[:k]

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    @staticmethod
    def stream_error(e: Exception) -> str:
        return sse(APIError(str(e), 500).to_dict())


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, req: CompletionRequest, raw_request: Request) -> Response:
        arrival = time.monotonic()
        model = self.check_model(req.model)
        if req.suffix:
            raise APIError("suffix is not supported.", param="suffix")
        prompts = _split_prompts(req.prompt)
        if req.echo and req.logprobs is not None:
            raise APIError(
                "echo with logprobs needs prompt logprobs, which this server does not compute.", param="echo"
            )
        params = to_sampling_params(req, req.max_tokens, req.logprobs, req.best_of)
        engine_prompts = await self.in_tokenizer_thread(self._prepare_prompts, prompts, bool(req.echo))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await self.add_requests(request_id, engine_prompts, params, arrival)
        n = params.n
        if req.stream:
            gen = self._stream(req, request_id, model, streams, engine_prompts, n)
            return AbortOnCloseStreamingResponse(gen, streams)
        try:
            finals = await self.collect(streams, raw_request)
        except ClientDisconnected:
            return JSONResponse(APIError("Client disconnected.", 499).to_dict(), status_code=499)
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for i, out in enumerate(finals):
            prompt_tokens += len(out.prompt_token_ids)
            # The engine's order: sequence order, or best first when best_of > n (whose indices
            # are then sequence ids, not 0..n-1): OpenAI numbers the n choices of a prompt 0..n-1.
            for rank, c in enumerate(out.outputs):
                completion_tokens += len(c.token_ids)
                text = (engine_prompts[i]["prompt"] + c.text) if req.echo else c.text
                logprobs = None
                if req.logprobs is not None and c.logprobs is not None:
                    logprobs = self._logprobs(c.token_ids, c.logprobs, req.logprobs, 0)
                choices.append(
                    {
                        "index": i * n + rank,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                )
        choices.sort(key=lambda c: c["index"])
        return JSONResponse(
            {
                "id": request_id,
                "object": "text_completion",
                "created": int(time.time()),
                "model": model,
                "choices": choices,
                "usage": self.usage(prompt_tokens, completion_tokens),
            }
        )

    def _prepare_prompts(self, prompts: list[str | list[int]], echo: bool) -> list[dict]:
        """Engine prompt dicts; token ids are computed here so the engine thread need not tokenize."""
        out = []
        for p in prompts:
            if isinstance(p, str):
                out.append({"prompt": p, "prompt_token_ids": self.encode(p)})
            else:
                d: dict[str, Any] = {"prompt_token_ids": p}
                if echo:
                    try:
                        d["prompt"] = self.tokenizer.decode(p)
                    except Exception:  # ids out of range: the engine rejects the prompt with a 400
                        d["prompt"] = ""
                out.append(d)
        return out

    def _logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]], top: int, offset: int) -> dict:
        """OpenAI completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for t, lp in zip(token_ids, logprobs, strict=False):
            s = self.token_str(t)
            tokens.append(s)
            token_lps.append(self.logprob(lp.get(t, _LOGPROB_FLOOR)))
            tops.append({self.token_str(k): self.logprob(v) for k, v in self.top_entries(lp, top)})
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    async def _stream(
        self,
        req: CompletionRequest,
        request_id: str,
        model: str,
        streams: list[RequestStream],
        prompts: list[dict],
        n: int,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        states: dict[int, _ChoiceState] = {}
        prompt_tokens = [len(p["prompt_token_ids"]) for p in prompts]
        completion_tokens: dict[int, int] = {}
        usage_null = {"usage": None} if req.include_usage else {}

        chunk = chunk_writer(request_id, "text_completion", created, model)

        try:
            async for i, out in merge_streams(streams):
                for c in out.outputs:
                    idx = i * n + c.index
                    st = states.setdefault(idx, _ChoiceState())
                    if st.finished:
                        continue
                    delta = c.text[st.text_len :]
                    new_ids = c.token_ids[st.num_tokens :]
                    if req.echo and not st.started:
                        delta = prompts[i].get("prompt", "") + delta
                    finish = c.finish_reason
                    want_lp = req.logprobs is not None and c.logprobs is not None and new_ids
                    if not delta and finish is None and not want_lp:
                        continue
                    logprobs = None
                    if want_lp:
                        logprobs = self._logprobs(new_ids, c.logprobs[st.num_tokens :], req.logprobs, st.text_offset)
                        st.text_offset += sum(len(s) for s in logprobs["tokens"])
                    st.text_len = max(st.text_len, len(c.text))
                    st.num_tokens = len(c.token_ids)
                    st.started = True
                    choice = {
                        "index": idx,
                        "text": delta,
                        "logprobs": logprobs,
                        "finish_reason": finish,
                        "stop_reason": c.stop_reason if finish else None,
                    }
                    if finish is not None:
                        st.finished = True
                        completion_tokens[idx] = len(c.token_ids)
                    yield chunk([choice], **usage_null)
            if req.include_usage:
                yield chunk([], usage=self.usage(sum(prompt_tokens), sum(completion_tokens.values())))
            yield sse("[DONE]")
        except (RequestFailedError, EngineDeadError) as e:
            yield self.stream_error(e)
            yield sse("[DONE]")
        finally:
            abort_all(streams)


def _split_prompts(prompt: str | list) -> list[str | list[int]]:
    """OpenAI's four prompt forms -> a list of prompts (each a string or a list of token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError("prompt must not be empty.", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    prompts = list(prompt)
    if any(isinstance(p, list) and not p for p in prompts):
        raise APIError("prompt must not contain an empty list of token ids.", param="prompt")
    return prompts
