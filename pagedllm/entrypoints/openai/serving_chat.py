"""/v1/chat/completions: the tokenizer's chat template turns messages into a prompt."""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedllm.engine.client import OutputStream
from pagedllm.engine.intake import truncate_prompt
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from pagedllm.entrypoints.openai.reasoning_parsers import ReasoningParser, ReasoningSplit, reasoning_tokens
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
from pagedllm.entrypoints.openai.structured import check_constraint_size, structured_outputs_of
from pagedllm.entrypoints.openai.tool_calls import ToolPlan, assistant_message, plan_tools, template_messages
from pagedllm.entrypoints.openai.tool_parsers import ToolParser
from pagedllm.entrypoints.openai.tool_streaming import ToolCallStream
from pagedllm.logprobs import Logprob
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output import StructuredOutputsParams

logger = logging.getLogger("pagedllm.server")

# apply_chat_template's own parameters: never let a request's chat_template_kwargs override them.
_RESERVED_TEMPLATE_KWARGS = {
    "conversation",
    "chat_template",
    "tokenize",
    "add_generation_prompt",
    "return_dict",
    "return_tensors",
    "padding",
    "truncation",
    "max_length",
    "tools",
    "documents",
    "continue_final_message",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
}


def _text_len(m: ChatMessage) -> int:
    """Characters of a message's text (of its parts), to measure before rendering."""
    if isinstance(m.content, list):
        return sum(len(p.text or "") for p in m.content)
    return len(m.content or "")


def _message_dict(m: ChatMessage) -> dict:
    """A message as chat templates expect it: content as one string (text parts joined)."""
    d = m.model_dump(exclude_none=True)
    content = m.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise APIError(
                    f"Message content of type {part.type!r} is not supported; only text is.", param="messages"
                )
            texts.append(part.text)
        d["content"] = "\n".join(texts)
    elif content is None:
        d["content"] = ""
    return d


@dataclass
class PreparedChat:
    """A checked chat request ready for the engine (OpenAIServingChat.prepare)."""

    model: str
    plan: ToolPlan | None
    params: SamplingParams
    prompt: dict  # {"prompt": text, "prompt_token_ids": ids}
    constraint_field: str | None  # the request field the output constraint came from


class OpenAIServingChat(OpenAIServing):
    # Set by build_app: how tool_choice "auto" finds the calls in the model's text.
    tool_parser: ToolParser | None = None
    enable_auto_tools: bool = False
    # Set by build_app (--reasoning-parser): which part of the output is reasoning.
    reasoning_parser: ReasoningParser | None = None

    def split(self, text: str, finished: bool = True) -> ReasoningSplit:
        """An output's reasoning and content (all content without a reasoning parser)."""
        if self.reasoning_parser is None:
            return ReasoningSplit(None, text)
        return self.reasoning_parser.split(text, finished)

    def reasoning_tokens(self, text: str, token_ids: list[int]) -> int:
        """The output's tokens of its reasoning section (0 without a reasoning parser)."""
        return reasoning_tokens(self.reasoning_parser, text, token_ids, self.decode_kept)

    def thought(self, reasoning: int) -> int | None:
        """Chat's usage counts reasoning tokens only with a reasoning parser (as vLLM)."""
        return reasoning if self.reasoning_parser is not None else None

    def _constraint(
        self, req: ChatCompletionRequest
    ) -> tuple[ToolPlan | None, StructuredOutputsParams | None, str | None]:
        """The request's tool plan, output constraint (a required / named tool choice's, or
        response_format's and the like: not both) and the field the constraint came from."""
        plan = plan_tools(
            req.tools, req.tool_choice, self.tool_parser, self.enable_auto_tools, req.parallel_tool_calls is not False
        )
        constraint, field = structured_outputs_of(req, self.limits)
        if plan is not None and plan.constraint is not None:
            if constraint is not None:
                raise APIError(
                    "A required or named tool_choice constrains the output already; drop response_format.",
                    param="tool_choice",
                )
            constraint, field = plan.constraint, "tools"
            check_constraint_size(constraint, field, self.limits)
        if constraint is not None and self.reasoning_parser is not None:  # constrain only the answer
            constraint = dataclasses.replace(constraint, reasoning_prefix=self.reasoning_parser.grammar_prefix)
        return plan, constraint, field

    async def prepare(self, req: ChatCompletionRequest, continue_final_message: bool = False) -> PreparedChat:
        """Everything before the engine: the checks and caps, the tool plan and output constraint,
        the sampling parameters and the rendered, truncated prompt. The one preparation of the
        chat path, shared with the endpoints whose requests become chat requests (/v1/responses:
        serving_responses.py, /v1/messages: serving_messages.py); the caller adds the prompt to
        the engine (add_requests) under its own request id, or only counts it (count_tokens).
        ``continue_final_message``: the answer continues the last (assistant) message."""
        model = self.check_model(req.model)
        if req.top_logprobs and not req.logprobs:
            raise APIError("When using top_logprobs, logprobs must be set to true.", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if len(req.messages) > self.limits.max_messages:
            raise APIError(
                f"messages has {len(req.messages)} messages; at most {self.limits.max_messages} are allowed.",
                param="messages",
            )
        plan, constraint, constraint_field = self._constraint(req)
        if plan is not None and plan.keeps_special_tokens:  # else the calls' marker is decoded away
            req.skip_special_tokens = False
        self.check_control_sizes(req)
        params = to_sampling_params(
            req,
            max_tokens,
            logprobs,
            prompt_logprobs=req.prompt_logprobs,
            defaults=self.default_sampling,
            structured_outputs=constraint,
        )
        self.check_limits(req, 1)
        self.check_prompt_chars([sum(_text_len(m) for m in req.messages)], "messages")  # before rendering
        prompt = await self.in_tokenizer_thread(
            self.render,
            req.messages,
            req.add_generation_prompt is not False and not continue_final_message,
            req.chat_template_kwargs,
            tools=plan.tools if plan is not None else None,
            continue_final_message=continue_final_message,
        )
        # The engine would slice the same; here too, so the streamed usage counts what runs.
        prompt["prompt_token_ids"] = truncate_prompt(prompt["prompt_token_ids"], params, self.max_model_len)
        self.check_request_tokens([prompt], params)
        if req.prompt_logprobs is not None:
            n_prompt = len(prompt["prompt_token_ids"])
            shape = PromptResponse([n_prompt], [0], params.n, prompt_top=self.num_top(req.prompt_logprobs))
            check_prompt_response(shape, self.limits.max_prompt_response_bytes)
        return PreparedChat(model, plan, params, prompt, constraint_field)

    async def create_chat_completion(self, req: ChatCompletionRequest, raw_request: Request) -> Response:
        arrival = time.monotonic()
        prep = await self.prepare(req)
        model, plan, params, prompt = prep.model, prep.plan, prep.params, prep.prompt
        logprobs = params.logprobs
        top = self.num_top(logprobs)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self.add_requests(request_id, [prompt], params, arrival, prep.constraint_field)
        if req.stream:
            return AbortOnCloseStreamingResponse(
                self._stream(req, request_id, model, streams, prompt, params.n, plan), streams
            )
        try:
            (out,) = await self.collect(streams, raw_request)
        except ClientDisconnected:
            return JSONResponse(APIError("Client disconnected.", 499).to_dict(), status_code=499)
        choices, completion_tokens, thinking = [], 0, 0
        for rank, c in enumerate(out.outputs):  # engine order (best first for best_of): choices 0..n-1
            completion_tokens += len(c.token_ids)
            thinking += self.reasoning_tokens(c.text, c.token_ids)
            lp = None
            if logprobs is not None and c.logprobs is not None:
                lp = {"content": self._logprobs(c.token_ids, c.logprobs, top)}
            parts = self.split(c.text)
            message, finish_reason = assistant_message(plan, parts.content, c.finish_reason)
            if self.reasoning_parser is not None:  # vLLM's field, and its newer name
                message["reasoning_content"] = message["reasoning"] = parts.reasoning
            choices.append(
                {
                    "index": rank,
                    "message": message,
                    "logprobs": lp,
                    "finish_reason": finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        body = {
            "id": request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "usage": self.usage(
                len(out.prompt_token_ids), completion_tokens, out.num_cached_tokens, self.thought(thinking)
            ),
        }
        if req.prompt_logprobs is not None:  # vLLM's: on the response, not per choice
            body["prompt_logprobs"] = self.vllm_prompt_logprobs(out, self.num_top(req.prompt_logprobs))
        return await self.json_response(lambda: body)  # encoded off the event loop

    def render(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        template_kwargs: dict | None,
        add_special_tokens: bool = False,
        tools: list[dict] | None = None,
        continue_final_message: bool = False,
    ) -> dict:
        """Chat template -> text -> ids (in the tokenizer thread). No special tokens are added by
        default: the template has them (BOS...)."""
        text = self.render_text(messages, add_generation_prompt, template_kwargs, tools, continue_final_message)
        return {"prompt": text, "prompt_token_ids": self.encode(text, add_special_tokens=add_special_tokens)}

    def render_text(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        template_kwargs: dict | None,
        tools: list[dict] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """The chat template applied to ``messages`` (and ``tools``); the input's faults are 400s.
        ``continue_final_message``: the text ends inside the last message, which the answer continues."""
        dicts = template_messages([_message_dict(m) for m in messages])
        kwargs = {k: v for k, v in (template_kwargs or {}).items() if k not in _RESERVED_TEMPLATE_KWARGS}
        if tools:
            kwargs["tools"] = tools
        tok = self.tokenizer
        if not getattr(tok, "chat_template", None):
            raise APIError("This model's tokenizer has no chat template; use /v1/completions.")
        try:
            if continue_final_message:  # passed only when set: not every tokenizer takes the argument
                kwargs["continue_final_message"] = True
            text = tok.apply_chat_template(dicts, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)
        except jinja2.TemplateError as e:  # "roles must alternate", raise_exception(...): the input's fault
            raise APIError(f"Could not apply the chat template: {e}", param="messages") from e
        except Exception as e:  # e.g. a TypeError inside the template: our text stays in the log
            logger.warning("chat template failed: %r", e)
            raise APIError("Could not apply the chat template to these messages.", param="messages") from e
        return text

    def _logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob]], top: int) -> list[dict]:
        """OpenAI's chat logprobs: per token {token, logprob, bytes, top_logprobs: [{token, logprob,
        bytes}, ...]} (the top ``top``, best first)."""
        entries = []
        for t, lp in zip(token_ids, logprobs, strict=False):
            s = self.token_str(t)
            entries.append(
                {
                    "token": s,
                    "logprob": self.token_logprob(lp, t),
                    "bytes": list(s.encode("utf-8")),
                    "top_logprobs": [
                        {
                            "token": (ks := self.token_str(k)),
                            "logprob": self.logprob(v),
                            "bytes": list(ks.encode("utf-8")),
                        }
                        for k, v in self.top_entries(lp, top)
                    ],
                }
            )
        return entries

    async def _stream(
        self,
        req: ChatCompletionRequest,
        request_id: str,
        model: str,
        streams: list[OutputStream],
        prompt: dict,
        n: int,
        plan: ToolPlan | None = None,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        states: dict[int, _ChoiceState] = {}
        completion_tokens: dict[int, int] = {}
        thinking: dict[int, int] = {}  # per choice: its reasoning tokens
        usage_null = {"usage": None} if req.include_usage else {}
        want_lp = bool(req.logprobs)
        top = self.num_top(req.top_logprobs or 0)

        chunk = chunk_writer(request_id, "chat.completion.chunk", created, model)

        cached_tokens = 0  # set at admission, so by the first output
        reasoning_sent: dict[int, int] = {}  # per choice: characters of reasoning sent
        tool_streams: dict[int, ToolCallStream] = {}  # per choice: its content and tool calls
        try:
            async for _, out in merge_streams(streams):
                cached_tokens = out.num_cached_tokens
                for c in out.outputs:
                    st = states.setdefault(c.index, _ChoiceState())
                    if st.finished:
                        continue
                    if not st.started:  # OpenAI's first chunk: the role, empty content
                        st.started = True
                        yield chunk([_delta_choice(c.index, {"role": "assistant", "content": ""})], **usage_null)
                    finish = c.finish_reason
                    parts = self.split(c.text, finish is not None)
                    thought = (parts.reasoning or "")[reasoning_sent.get(c.index, 0) :]
                    if thought:  # reasoning in deltas of its own, before any content
                        reasoning_sent[c.index] = len(parts.reasoning or "")
                        reasoning = {"reasoning_content": thought, "reasoning": thought}
                        yield chunk([_delta_choice(c.index, reasoning)], **usage_null)
                    tcs = tool_streams.setdefault(c.index, ToolCallStream(plan))
                    step = tcs.update(parts.content, finish is not None)
                    delta = step.content
                    new_ids = c.token_ids[st.num_tokens :]
                    lp_new = want_lp and c.logprobs is not None and bool(new_ids)
                    if not delta and not step.calls and finish is None and not lp_new:
                        continue
                    lp = {"content": self._logprobs(new_ids, c.logprobs[st.num_tokens :], top)} if lp_new else None
                    st.num_tokens = len(c.token_ids)
                    if step.calls and delta:  # the text before the calls goes first
                        yield chunk([{**_delta_choice(c.index, {"content": delta}), "logprobs": lp}], **usage_null)
                        delta, lp = "", None
                    for d in step.calls:  # a call opens (id, name), then its arguments as they grow
                        tool_delta = {"tool_calls": [d.to_openai()]}
                        yield chunk([{**_delta_choice(c.index, tool_delta), "logprobs": lp}], **usage_null)
                        lp = None
                    if finish == "stop" and tcs.has_calls:
                        finish = "tool_calls"
                    if finish is None and not delta and not lp:
                        continue
                    choice = {
                        "index": c.index,
                        "delta": {"content": delta} if delta else {},
                        "logprobs": lp,
                        "finish_reason": finish,
                    }
                    if finish is not None:
                        choice["stop_reason"] = c.stop_reason
                        st.finished = True
                        completion_tokens[c.index] = len(c.token_ids)
                        thinking[c.index] = self.reasoning_tokens(c.text, c.token_ids)
                    yield chunk([choice], **usage_null)
            if req.include_usage:
                n_prompt, n_thought = len(prompt["prompt_token_ids"]), sum(thinking.values())
                usage = self.usage(n_prompt, sum(completion_tokens.values()), cached_tokens, self.thought(n_thought))
                yield chunk([], usage=usage)
            yield sse("[DONE]")
        except Exception as e:  # after the 200: an error event and [DONE], never a cut stream
            yield self.stream_error(e)
            yield sse("[DONE]")
        finally:
            abort_all(streams)


def _delta_choice(index: int, delta: dict) -> dict:
    """A streamed choice that carries only ``delta`` (no logprobs, not finished)."""
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
