"""/v1/completions: prompt splitting and validation, the non-streamed response and the stream.

The shared endpoint machinery is OpenAIServing (serving_engine.py) and streaming.py.

Choices are numbered ``prompt_index * n + output.index`` as in OpenAI, so n > 1 works unchanged
once the engine returns several CompletionOutputs per RequestOutput.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedllm.engine.async_engine import EngineDeadError, RequestFailedError, RequestStream
from pagedllm.entrypoints.openai.protocol import APIError, CompletionRequest, to_sampling_params
from pagedllm.entrypoints.openai.serving_engine import _LOGPROB_FLOOR, OpenAIServing
from pagedllm.entrypoints.openai.streaming import (
    AbortOnCloseStreamingResponse,
    ClientDisconnected,
    _ChoiceState,
    abort_all,
    chunk_writer,
    merge_streams,
    sse,
)


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, req: CompletionRequest, raw_request: Request) -> Response:
        arrival = time.monotonic()
        model = self.check_model(req.model)
        if req.suffix:
            raise APIError("suffix is not supported.", param="suffix")
        prompts = _split_prompts(req.prompt)
        # echo with logprobs: the prompt's tokens lead the logprobs too (OpenAI's legacy API).
        prompt_k = req.prompt_logprobs
        if req.echo and req.logprobs is not None:
            prompt_k = max(prompt_k or 0, req.logprobs)
        params = to_sampling_params(req, req.max_tokens, req.logprobs, req.best_of, prompt_k, self.default_sampling)
        self.check_limits(req, len(prompts), req.best_of)
        engine_prompts = await self.in_tokenizer_thread(self._prepare_prompts, prompts, bool(req.echo))
        self.check_request_tokens(engine_prompts, params)
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
                    head = self._echo_logprobs(req, out) if req.echo else None
                    offset = head["text_offset_end"] if head else 0
                    logprobs = _join(head, self._logprobs(c.token_ids, c.logprobs, req.logprobs, offset))
                choice = {
                    "index": i * n + rank,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._vllm_prompt_logprobs(out, req.prompt_logprobs)
                choices.append(choice)
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

    def _echo_logprobs(self, req: CompletionRequest, out) -> dict:
        """The echoed prompt's part of the logprobs: its first token has none (null), as in OpenAI."""
        ids, plp = out.prompt_token_ids, out.prompt_logprobs or []
        part = self._logprobs(ids[1:], plp[1:], req.logprobs, len(self.token_str(ids[0])))
        part["tokens"].insert(0, self.token_str(ids[0]))
        part["token_logprobs"].insert(0, None)
        part["top_logprobs"].insert(0, None)
        part["text_offset"].insert(0, 0)
        part["text_offset_end"] = part["text_offset"][-1] + len(part["tokens"][-1])
        return part

    def _vllm_prompt_logprobs(self, out, top: int) -> list[dict | None]:
        """vLLM's choice field: None, then per prompt token {token id: {logprob, decoded_token}} for
        that token and the top ``top`` (no rank: the engine does not compute vocabulary ranks)."""
        result: list[dict | None] = [None]
        for t, lp in zip(out.prompt_token_ids[1:], (out.prompt_logprobs or [])[1:], strict=False):
            entries = dict(self.top_entries(lp, top))
            entries.setdefault(t, lp.get(t, _LOGPROB_FLOOR))
            result.append(
                {str(k): {"logprob": self.logprob(v), "decoded_token": self.token_str(k)} for k, v in entries.items()}
            )
        return result

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
                    head = None
                    if req.echo and not st.started:
                        delta = prompts[i].get("prompt", "") + delta
                        if req.logprobs is not None:
                            head = self._echo_logprobs(req, out)
                            st.text_offset = head["text_offset_end"]
                    finish = c.finish_reason
                    want_lp = req.logprobs is not None and c.logprobs is not None and (new_ids or head)
                    if not delta and finish is None and not want_lp:
                        continue
                    logprobs = None
                    if want_lp:
                        part = self._logprobs(new_ids, c.logprobs[st.num_tokens :], req.logprobs, st.text_offset)
                        st.text_offset += sum(len(s) for s in part["tokens"])
                        logprobs = _join(head, part)
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
                    if req.prompt_logprobs is not None and not st.sent_prompt_logprobs:
                        choice["prompt_logprobs"] = self._vllm_prompt_logprobs(out, req.prompt_logprobs)
                        st.sent_prompt_logprobs = True
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


def _join(head: dict | None, part: dict) -> dict:
    """The echoed prompt's logprobs followed by the completion's."""
    if head is None:
        return part
    return {k: head[k] + part[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


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
