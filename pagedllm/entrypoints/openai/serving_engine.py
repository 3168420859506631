"""OpenAIServing: what the completions and chat endpoints share.

The model-name check, tokenization off the event loop, adding a request's prompts to the engine
all-or-nothing, collecting their final outputs (aborting on client disconnect), logprob
formatting and usage counts.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from pagedllm.engine.client import EngineClient, OutputStream
from pagedllm.engine.request_stream import EngineDeadError, RequestFailedError
from pagedllm.entrypoints.openai.errors import APIError, error_from_value_error
from pagedllm.entrypoints.openai.limits import ServerLimits
from pagedllm.entrypoints.openai.protocol import _SamplingRequest
from pagedllm.entrypoints.openai.sampling import _FIELDS
from pagedllm.entrypoints.openai.streaming import ClientDisconnected, abort_all, merge_streams, sse, wait_for_disconnect
from pagedllm.logprobs import Logprob
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.grammar import GrammarError

logger = logging.getLogger("pagedllm.server")

_LOGPROB_FLOOR = -9999.0  # JSON has no -inf; vLLM clamps the same way
_DECODE_LOCK = threading.Lock()  # see token_str


def json_bytes(body: dict) -> bytes:
    """``body`` as FastAPI's JSONResponse encodes it, one item of its lists (choices) at a time:
    the C encoder holds the GIL for a whole call, and the event loop runs between the calls."""

    def dumps(v: Any) -> str:
        return json.dumps(v, ensure_ascii=False, allow_nan=False, separators=(",", ":"))

    fields = []
    for k, v in body.items():
        value = "[" + ",".join(map(dumps, v)) + "]" if isinstance(v, list) else dumps(v)
        fields.append(f"{dumps(k)}:{value}")
    return ("{" + ",".join(fields) + "}").encode("utf-8")


class OpenAIServing:
    """State and helpers common to the OpenAI endpoints."""

    def __init__(
        self,
        engine: EngineClient,
        served_model_names: list[str],
        tokenizer: Any,
        decode_tokenizer: Any,
        tokenizer_pool: ThreadPoolExecutor,
        limits: ServerLimits | None = None,
    ) -> None:
        # `tokenizer` runs on the tokenizer pool (one thread unless it is thread-safe),
        # `decode_tokenizer` decodes logprob tokens (token_str), the engine thread decodes with the
        # engine's: the same instance only where that is thread-safe
        # (pagedllm.tokenizer.shareable_across_threads), else separate ones.
        self.engine = engine
        self.served_model_names = served_model_names
        self.tokenizer = tokenizer
        self.decode_tokenizer = decode_tokenizer
        self.pool = tokenizer_pool
        facts = engine.facts
        self.max_model_len: int = facts.max_model_len
        self.vocab_size: int = facts.vocab_size
        self.limits = limits or ServerLimits()
        # Defaults of the fields a request leaves out: the model's generation config (engine argument
        # generation_config), as vLLM applies it.
        self.default_sampling: dict[str, Any] = dict(facts.default_sampling_params)
        # Called with (n, max_tokens) of every engine request added (the metrics' request_params_*).
        self.on_request_params: Callable[[int, int], None] | None = None
        # Default: what the KV cache holds; a request needing more would only preempt itself.
        self.max_request_tokens: int = self.limits.max_request_tokens or facts.kv_capacity_tokens
        # Text is refused before it is tokenized (a megabyte takes about a second of a tokenizer
        # thread) when it holds more characters than the tokens it may use could cover at
        # limits.max_chars_per_token a token. 16 by default: measured with the default model's
        # tokenizer, markdown prose averages 3.1 characters a token, Python 3.8, JSON 2.3; only
        # text made mostly of long runs of one character goes beyond (64 spaces or "=" are one
        # token there). Never more than twice the longest vocabulary entry, which no token exceeds.
        longest = max((len(t) for t in tokenizer.get_vocab()), default=16)
        self.chars_per_token = min(self.limits.max_chars_per_token, 2 * max(longest, 1))
        self.max_prompt_chars = self.chars_per_token * min(self.max_model_len, self.max_request_tokens)
        self.max_request_chars = self.chars_per_token * self.max_request_tokens  # a request's prompts together

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

    def check_limits(self, req: _SamplingRequest, num_prompts: int, best_of: int | None = None) -> None:
        """The per-request caps that can be checked before any work (see ServerLimits); 400 naming the field."""
        lim = self.limits
        if num_prompts > lim.max_prompts_per_request:
            raise APIError(
                f"prompt has {num_prompts} prompts; at most {lim.max_prompts_per_request} are allowed per request.",
                param="prompt",
            )
        per_prompt = max(req.n or 1, best_of or 1)
        if num_prompts * per_prompt > lim.max_seqs_per_request:
            raise APIError(
                f"{num_prompts} prompt(s) x {per_prompt} sequences (n / best_of) is more than the "
                f"{lim.max_seqs_per_request} sequences allowed per request.",
                param="n",
            )
        stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        if len(stop) > lim.max_stop_strings:
            raise APIError(f"stop has {len(stop)} strings; at most {lim.max_stop_strings} are allowed.", param="stop")
        longest = max((len(x) for x in stop), default=0)
        if longest > lim.max_stop_string_chars:
            raise APIError(
                f"stop strings must be at most {lim.max_stop_string_chars} characters long, got one of {longest}.",
                param="stop",
            )
        # Each bad word is tokenized on the engine thread: bounded as stop strings are.
        words = req.bad_words or []
        if len(words) > lim.max_stop_strings or max(map(len, words), default=0) > lim.max_stop_string_chars:
            raise APIError(
                f"bad_words may hold at most {lim.max_stop_strings} words of at most "
                f"{lim.max_stop_string_chars} characters.",
                param="bad_words",
            )
        if req.stop_token_ids is not None and len(req.stop_token_ids) > lim.max_stop_token_ids:
            raise APIError(
                f"stop_token_ids has {len(req.stop_token_ids)} ids; at most {lim.max_stop_token_ids} are allowed.",
                param="stop_token_ids",
            )

    def check_control_sizes(self, req: _SamplingRequest) -> None:
        """Caps on token-control lists, checked before they are copied or turned into tensors: more
        allowed_token_ids than the vocabulary repeat ids, logit_bias at OpenAI's 300 entries
        (ServerLimits.max_logit_bias)."""
        if req.allowed_token_ids is not None and len(req.allowed_token_ids) > self.vocab_size:
            raise APIError(
                f"allowed_token_ids has {len(req.allowed_token_ids)} ids; at most the vocabulary's "
                f"{self.vocab_size} are allowed.",
                param="allowed_token_ids",
            )
        if req.logit_bias is not None and len(req.logit_bias) > self.limits.max_logit_bias:
            raise APIError(
                f"logit_bias has {len(req.logit_bias)} entries; at most {self.limits.max_logit_bias} are allowed.",
                param="logit_bias",
            )

    def check_prompt_chars(self, lengths: list[int], param: str = "prompt") -> None:
        """Refuses text before it is tokenized (see __init__): each prompt's text (of ``lengths``
        characters) at most max_prompt_chars characters, a request's together max_request_chars."""
        longest = max(lengths, default=0)
        if longest > self.max_prompt_chars:
            tokens = self.max_prompt_chars // self.chars_per_token
            raise APIError(
                f"The prompt is {longest} characters long: more than the {tokens} "
                f"tokens it may use (this model's maximum context length is {self.max_model_len} tokens) could hold "
                f"at {self.chars_per_token} characters a token ({self.max_prompt_chars} characters). Shorten it, "
                "or send token ids.",
                param=param,
                code="context_length_exceeded",
            )
        total = sum(lengths)
        if total > self.max_request_chars:
            raise APIError(
                f"The prompts are {total} characters long together: more than the {self.max_request_tokens} tokens "
                f"one request may use could hold at {self.chars_per_token} characters a token "
                f"({self.max_request_chars} characters). Send fewer prompts, or token ids.",
                param=param,
            )

    def check_request_tokens(self, prompts: list[dict], params: SamplingParams) -> None:
        """Caps the KV tokens one request may hold at once: prompts + every sequence's completion."""
        per_prompt = max(params.n, params.best_of or 1)
        total = 0
        for p in prompts:
            n_prompt = len(p["prompt_token_ids"])
            max_tokens = params.max_tokens if params.max_tokens is not None else max(self.max_model_len - n_prompt, 0)
            total += n_prompt + per_prompt * max_tokens
        if total > self.max_request_tokens:
            raise APIError(
                f"The request needs up to {total} tokens (prompts + {per_prompt} sequence(s) x max_tokens per "
                f"prompt); at most {self.max_request_tokens} are allowed per request. Reduce max_tokens, n or "
                "the number of prompts.",
                param="max_tokens",
            )

    async def in_tokenizer_thread(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """Tokenizer work off the event loop: a long prompt takes a while to encode."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args, **kwargs))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenizes (in a tokenizer thread); a text too long to fit is a 400 before tokenizing."""
        self.check_prompt_chars([len(text)])
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one instance per server, lives as long
    def token_str(self, token_id: int) -> str:
        # Responses are built in worker threads too (json_response): one decode at a time, as the
        # decode tokenizer may not be thread-safe. Only cache misses take the lock.
        with _DECODE_LOCK:
            return self.decode_tokenizer.decode([token_id], skip_special_tokens=False)

    def decode_kept(self, token_ids: list[int]) -> str:
        """The tokens' text, special tokens kept (under the decode lock, as token_str)."""
        with _DECODE_LOCK:
            return self.decode_tokenizer.decode(token_ids, skip_special_tokens=False)

    async def json_response(self, build: Callable[..., dict], *args: Any) -> Response:
        """``build(*args)`` as a JSON response, built and encoded in a worker thread: a response
        with logprobs can hold megabytes, which on the event loop would stall every other request."""
        return Response(await asyncio.to_thread(lambda: json_bytes(build(*args))), media_type="application/json")

    async def add_requests(
        self,
        request_id: str,
        prompts: list[dict],
        params: SamplingParams,
        arrival_time: float,
        constraint_field: str | None = None,
    ) -> list[OutputStream]:
        """Adds one engine request per prompt, all or nothing; bad input becomes a 400 (one whose
        output constraint cannot compile names ``constraint_field``, where it came from)."""
        streams: list[OutputStream] = []
        try:
            for i, p in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(await self.engine.add_request(rid, p, params, arrival_time))
        except BaseException as e:
            abort_all(streams)
            if isinstance(e, GrammarError):
                raise APIError(str(e), 400, param=constraint_field) from e
            if isinstance(e, (ValueError, TypeError)):
                err = error_from_value_error(e, _FIELDS)
                if len(prompts) > 1 and err.param is None:
                    err.message = f"Prompt {len(streams)}: {err.message}"
                raise err from e
            if isinstance(e, NotImplementedError):
                raise APIError(str(e), 400) from e
            if isinstance(e, EngineDeadError):
                raise APIError("The engine is not running.", 503) from e
            raise
        if self.on_request_params is not None:
            for p in prompts:
                n_prompt = len(p["prompt_token_ids"])
                max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n_prompt
                self.on_request_params(params.n, max_tokens)
        return streams

    async def collect(self, streams: list[OutputStream], request: Request) -> list[RequestOutput]:
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
                except RequestFailedError as e:
                    raise APIError(str(e), 500) from e  # a generic message: details are in the log
                except EngineDeadError as e:
                    raise APIError("The engine is not running.", 503) from e
            logger.info("client disconnected: aborting %s", ", ".join(s.request_id for s in streams))
            raise ClientDisconnected
        finally:
            watcher.cancel()
            task.cancel()
            abort_all(streams)

    def logprob(self, v: float) -> float:
        return max(v, _LOGPROB_FLOOR) if v == v else _LOGPROB_FLOOR  # NaN -> floor

    def num_top(self, k: int | None) -> int:
        """How many top tokens a request's logprobs / prompt_logprobs show (-1: the vocabulary)."""
        return self.vocab_size if k == -1 else (k or 0)

    def token_logprob(self, lp: dict[int, Logprob], token_id: int) -> float:
        e = lp.get(token_id)
        return _LOGPROB_FLOOR if e is None else self.logprob(e.logprob)

    def top_entries(self, lp: dict[int, Logprob], k: int) -> list[tuple[int, float]]:
        """The k most likely tokens of one position, best first (the engine's dict also holds the
        chosen one); k = -1: every token the dict has (the whole vocabulary)."""
        items = sorted(((t, e.logprob) for t, e in lp.items()), key=lambda kv: -kv[1])
        return items if k < 0 else items[:k]

    def vllm_prompt_logprobs(self, out: RequestOutput, top: int) -> list[dict | None]:
        """vLLM's prompt_logprobs field: None, then per prompt token {token id: {logprob, rank,
        decoded_token}} for that token and the top ``top`` (-1: all)."""
        result: list[dict | None] = [None]
        for t, lp in zip(out.prompt_token_ids[1:], (out.prompt_logprobs or [])[1:], strict=False):
            keep = {k for k, _ in self.top_entries(lp, top)} | {t}
            result.append(
                {
                    str(k): {"logprob": self.logprob(e.logprob), "rank": e.rank, "decoded_token": self.token_str(k)}
                    for k, e in lp.items()
                    if k in keep
                }
            )
        return result

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, reasoning: int | None = None) -> dict:
        """OpenAI's usage. ``cached_tokens``: the prompt tokens the engine took from its prefix
        cache (RequestOutput.num_cached_tokens), always given, 0 on a miss or without prefix
        caching, as OpenAI's API does (vLLM only with --enable-prompt-tokens-details, and only
        when not 0). ``reasoning``: the completion tokens of its reasoning section, given with a
        reasoning parser (completion_tokens_details.reasoning_tokens)."""
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        }
        if reasoning is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
        return usage

    @staticmethod
    def stream_error(e: Exception) -> str:
        """The SSE error event that ends a stream which failed after its 200 went out (the caller
        sends ``[DONE]`` after it, as OpenAI's and vLLM's servers do, so clients see an error,
        not a cut connection)."""
        return sse(OpenAIServing.stream_failure(e).to_dict())

    @staticmethod
    def stream_failure(e: Exception) -> APIError:
        """What a client is told of a stream that failed after its 200 went out: the one choice of
        status and words, which each endpoint sends in its own event shape (stream_error here;
        Responses' and Messages' error events)."""
        if isinstance(e, RequestFailedError):  # its message is generic: the details are only logged
            return APIError(str(e), 500)
        if isinstance(e, EngineDeadError):
            return APIError("The engine is not running.", 503)
        logger.error("streamed response failed", exc_info=e)  # a bug of ours: its text stays in the log
        return APIError("Internal server error.", 500)
