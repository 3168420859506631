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

from pagedllm.engine.client import OutputStream
from pagedllm.engine.intake import truncate_prompt
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol import CompletionRequest
from pagedllm.entrypoints.openai.response_budget import PromptResponse, check_prompt_response
from pagedllm.entrypoints.openai.sampling import to_sampling_params
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing
from pagedllm.entrypoints.openai.streaming import (
    AbortOnCloseStreamingResponse,
    ClientDisconnected,
    _ChoiceState,
    abort_all,
    chunk_writer,
    merge_streams,
    sse,
)
from pagedllm.entrypoints.openai.structured import structured_outputs_of
from pagedllm.logprobs import Logprob
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, req: CompletionRequest, raw_request: Request) -> Response:
        arrival = time.monotonic()
        model = self.check_model(req.model)
        if req.suffix:
            raise APIError("suffix is not supported.", param="suffix")
        prompts = _split_prompts(req.prompt)
        self.check_control_sizes(req)
        # echo with logprobs: the prompt's tokens lead the logprobs too (OpenAI's legacy API).
        prompt_k = req.prompt_logprobs
        if req.echo and req.logprobs is not None:
            prompt_k = -1 if -1 in (prompt_k, req.logprobs) else max(prompt_k or 0, req.logprobs)
        # echo with max_tokens 0 (as vLLM): the prompt and its logprobs alone, nothing generated
        # (scoring a text, as lm-eval's loglikelihood does). The engine samples one token, unshown.
        max_tokens = 1 if self._echo_only(req) else req.max_tokens
        constraint, constraint_field = structured_outputs_of(req, self.limits)
        params = to_sampling_params(
            req, max_tokens, req.logprobs, req.best_of, prompt_k, self.default_sampling, constraint
        )
        self.check_limits(req, len(prompts), req.best_of)
        self.check_prompt_chars([len(p) for p in prompts if isinstance(p, str)])  # before tokenizing them
        engine_prompts = await self.in_tokenizer_thread(self._prepare_prompts, prompts, bool(req.echo), params)
        self.check_request_tokens(engine_prompts, params)
        n = params.n
        top = self.num_top(req.logprobs)
        self._check_prompt_response(req, engine_prompts, n, top)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await self.add_requests(request_id, engine_prompts, params, arrival, constraint_field)
        if req.stream:
            gen = self._stream(req, request_id, model, streams, engine_prompts, n, top)
            return AbortOnCloseStreamingResponse(gen, streams)
        try:
            finals = await self.collect(streams, raw_request)
        except ClientDisconnected:
            return JSONResponse(APIError("Client disconnected.", 499).to_dict(), status_code=499)
        # Built and encoded in a worker thread: a response with logprobs can run to megabytes.
        return await self.json_response(self._response, req, request_id, model, finals, engine_prompts, n, top)

    def _check_prompt_response(self, req: CompletionRequest, prompts: list[dict], n: int, top: int) -> None:
        echo = bool(req.echo)
        shape = PromptResponse(
            prompt_lens=[len(p["prompt_token_ids"]) for p in prompts],
            prompt_chars=[len(p.get("prompt", "")) if echo else 0 for p in prompts],
            choices_per_prompt=n,
            echo_top=top if echo and req.logprobs is not None else None,
            prompt_top=None if req.prompt_logprobs is None else self.num_top(req.prompt_logprobs),
        )
        check_prompt_response(shape, self.limits.max_prompt_response_bytes)

    def _response(
        self,
        req: CompletionRequest,
        request_id: str,
        model: str,
        finals: list[RequestOutput],
        engine_prompts: list[dict],
        n: int,
        top: int,
    ) -> dict:
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for i, out in enumerate(finals):
            prompt_tokens += len(out.prompt_token_ids)
            want_lp = req.logprobs is not None
            head = self._echo_logprobs(out, top) if req.echo and want_lp else None  # once per prompt
            # The engine's order: sequence order, or best first when best_of > n (whose indices
            # are then sequence ids, not 0..n-1): OpenAI numbers the n choices of a prompt 0..n-1.
            for rank, c in enumerate(out.outputs):
                shown_ids, shown_lps, shown_text = c.token_ids, c.logprobs, c.text
                if self._echo_only(req):
                    shown_ids, shown_lps, shown_text = [], [], ""
                completion_tokens += len(shown_ids)
                text = (engine_prompts[i]["prompt"] + shown_text) if req.echo else shown_text
                logprobs = None
                if want_lp and shown_lps is not None:
                    offset = head["text_offset_end"] if head else 0
                    logprobs = _join(head, self._logprobs(shown_ids, shown_lps, top, offset))
                choice = {
                    "index": i * n + rank,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                if req.prompt_logprobs is not None:
                    # Once per prompt, on its first choice: every choice shares the prompt.
                    choice["prompt_logprobs"] = (
                        self.vllm_prompt_logprobs(out, self.num_top(req.prompt_logprobs)) if rank == 0 else None
                    )
                choices.append(choice)
        choices.sort(key=lambda c: c["index"])
        return {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "usage": self.usage(prompt_tokens, completion_tokens, sum(f.num_cached_tokens for f in finals)),
        }

    @staticmethod
    def _echo_only(req: CompletionRequest) -> bool:
        return bool(req.echo) and req.max_tokens == 0

    def _prepare_prompts(self, prompts: list[str | list[int]], echo: bool, params: SamplingParams) -> list[dict]:
        """Engine prompt dicts; token ids are computed here so the engine thread need not tokenize.
        truncate_prompt_tokens is applied here too (the engine would slice the same ids), so that
        echo and the usage show the prompt the engine runs."""
        out = []
        for p in prompts:
            if isinstance(p, str) and params.truncate_prompt_tokens is None:
                out.append({"prompt": p, "prompt_token_ids": self.encode(p)})
            else:
                ids = self.encode(p) if isinstance(p, str) else p
                d: dict[str, Any] = {"prompt_token_ids": truncate_prompt(ids, params, self.max_model_len)}
                p = d["prompt_token_ids"]
                if echo:
                    try:
                        d["prompt"] = self.tokenizer.decode(p)
                    except Exception:  # ids out of range: the engine rejects the prompt with a 400
                        d["prompt"] = ""
                out.append(d)
        return out

    def _echo_logprobs(self, out, top: int) -> dict:
        """The echoed prompt's part of the logprobs: its first token has none (null), as in OpenAI."""
        ids, plp = out.prompt_token_ids, out.prompt_logprobs or []
        part = self._logprobs(ids[1:], plp[1:], top, len(self.token_str(ids[0])))
        part["tokens"].insert(0, self.token_str(ids[0]))
        part["token_logprobs"].insert(0, None)
        part["top_logprobs"].insert(0, None)
        part["text_offset"].insert(0, 0)
        part["text_offset_end"] = part["text_offset"][-1] + len(part["tokens"][-1])
        return part

    def _logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob]], top: int, offset: int) -> dict:
        """OpenAI completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for t, lp in zip(token_ids, logprobs, strict=False):
            s = self.token_str(t)
            tokens.append(s)
            token_lps.append(self.token_logprob(lp, t))
            tops.append({self.token_str(k): self.logprob(v) for k, v in self.top_entries(lp, top)})
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    async def _stream(
        self,
        req: CompletionRequest,
        request_id: str,
        model: str,
        streams: list[OutputStream],
        prompts: list[dict],
        n: int,
        top: int,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        states: dict[int, _ChoiceState] = {}
        prompt_tokens = [len(p["prompt_token_ids"]) for p in prompts]
        completion_tokens: dict[int, int] = {}
        cached_tokens: dict[int, int] = {}  # per prompt: set at admission, so by its first output
        usage_null = {"usage": None} if req.include_usage else {}
        echo_only = self._echo_only(req)
        heads: dict[int, dict] = {}  # prompt -> its echoed logprobs

        chunk = chunk_writer(request_id, "text_completion", created, model)

        try:
            async for i, out in merge_streams(streams):
                cached_tokens[i] = out.num_cached_tokens
                for c in out.outputs:
                    idx = i * n + c.index
                    st = states.setdefault(idx, _ChoiceState())
                    if st.finished:
                        continue
                    delta = c.text[st.text_len :]
                    new_ids = c.token_ids[st.num_tokens :]
                    if echo_only:
                        delta, new_ids = "", []
                    head = None
                    if req.echo and not st.started:
                        delta = prompts[i].get("prompt", "") + delta
                        if req.logprobs is not None:  # built once per prompt, shared by its choices
                            head = heads[i] if i in heads else heads.setdefault(i, self._echo_logprobs(out, top))
                            st.text_offset = head["text_offset_end"]
                    finish = c.finish_reason
                    want_lp = req.logprobs is not None and c.logprobs is not None and (new_ids or head)
                    if not delta and finish is None and not want_lp:
                        continue
                    logprobs = None
                    if want_lp:
                        part = self._logprobs(new_ids, c.logprobs[st.num_tokens :][: len(new_ids)], top, st.text_offset)
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
                        # Once per prompt, on its first choice (the others' first chunks: null).
                        choice["prompt_logprobs"] = (
                            self.vllm_prompt_logprobs(out, self.num_top(req.prompt_logprobs)) if c.index == 0 else None
                        )
                        st.sent_prompt_logprobs = True
                    if finish is not None:
                        st.finished = True
                        completion_tokens[idx] = 0 if echo_only else len(c.token_ids)
                    yield chunk([choice], **usage_null)
            if req.include_usage:
                usage = self.usage(sum(prompt_tokens), sum(completion_tokens.values()), sum(cached_tokens.values()))
                yield chunk([], usage=usage)
            yield sse("[DONE]")
        except Exception as e:  # after the 200: an error event and [DONE], never a cut stream
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
