"""Anthropic Messages <-> the chat path: a Messages request as a chat completion request, and a
finished output as Anthropic's content blocks and stop_reason.

The Messages endpoints reuse the chat path whole (chat template, tool plan, structured outputs for
a forced tool_choice, sampling conversion, the per-request caps): only the shapes differ.

- ``system`` -> a system message; text blocks -> the message's text (joined by newlines, as the
  chat path joins text parts); an assistant's ``tool_use`` blocks -> its tool_calls; a user's
  ``tool_result`` blocks -> tool messages (before the user's text: Anthropic puts results first).
  A final assistant message is continued (Anthropic's prefill), not answered.
- ``tool_choice``: auto -> "auto" (the server's tool-call parser), any -> "required", tool ->
  that function, none -> "none"; ``disable_parallel_tool_use``: at most one call.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from pagedllm.entrypoints.openai.anthropic_protocol import (
    CountTokensRequest,
    MessagesRequest,
    TextBlock,
    ToolChoice,
    ToolDefinition,
    ToolResultBlock,
    ToolUseBlock,
)
from pagedllm.entrypoints.openai.errors import APIError, validation_error_message
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.tool_calls import ToolPlan
from pagedllm.entrypoints.openai.tool_parsers import loads

_Block = TypeVar("_Block", bound=BaseModel)

# Which blocks each role may send here; everything else Anthropic defines (image, document,
# thinking, search_result, server tool blocks...) is a 400 naming where it is.
_BLOCKS = {"user": {"text", "tool_result"}, "assistant": {"text", "tool_use"}}


def _parse(model: type[_Block], data: Any, where: str) -> _Block:
    """``data`` as ``model``, or a 400 naming the place (``messages.2.content.0.text: ...``)."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in (where, *err["loc"]))
        raise APIError(f"{loc}: {err['msg']}.", param=where.split(".")[0]) from None


def _block_type(block: dict[str, Any], role: str, where: str, reasoning: bool) -> str:
    kind = block.get("type")
    if isinstance(kind, str) and kind in _BLOCKS[role]:
        return kind
    if kind in ("thinking", "redacted_thinking") and role == "assistant" and reasoning:
        return kind
    if kind in ("thinking", "redacted_thinking"):
        reason = "this server has no reasoning parser"
    else:
        reason = f"a {role} message may hold {' and '.join(sorted(_BLOCKS[role]))} blocks here"
    raise APIError(f"{where}: content blocks of type {kind!r} are not supported: {reason}.", param="messages")


def _text_of(blocks: list[dict[str, Any]], where: str) -> str:
    """Text blocks' text, joined by newlines (only text blocks allowed)."""
    texts = []
    for j, block in enumerate(blocks):
        if block.get("type") != "text":
            raise APIError(
                f"{where}.{j}: content blocks of type {block.get('type')!r} are not supported here; only text is.",
                param=where.split(".")[0],
            )
        texts.append(_parse(TextBlock, block, f"{where}.{j}").text)
    return "\n".join(texts)


def _chat_messages(req: CountTokensRequest, reasoning: bool) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.system is not None:
        system = req.system if isinstance(req.system, str) else _text_of(req.system, "system")
        out.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        for j, block in enumerate(m.content):
            where = f"messages.{i}.content.{j}"
            kind = _block_type(block, m.role, where, reasoning)
            if kind in ("thinking", "redacted_thinking"):
                # An earlier turn's thinking, sent back as Anthropic's clients do: chat templates
                # of reasoning models leave earlier reasoning out of the prompt, so it is too.
                continue
            if kind == "text":
                texts.append(_parse(TextBlock, block, where).text)
            elif kind == "tool_use":
                use = _parse(ToolUseBlock, block, where)
                calls.append({"id": use.id, "type": "function", "function": {"name": use.name, "arguments": use.input}})
            else:
                result = _parse(ToolResultBlock, block, where)
                content = result.content if isinstance(result.content, str) else _text_of(result.content, where)
                if result.is_error:  # the template has no field for it: the model reads it in the text
                    content = f"Error: {content}"
                results.append({"role": "tool", "tool_call_id": result.tool_use_id, "content": content})
        out.extend(results)
        if texts or calls or not results:
            message: dict[str, Any] = {"role": m.role, "content": "\n".join(texts)}
            if calls:
                message["tool_calls"] = calls
            out.append(message)
    return out


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        t = _parse(ToolDefinition, tool, f"tools.{i}")
        fn: dict[str, Any] = {"name": t.name, "parameters": t.input_schema}
        if t.description is not None:
            fn["description"] = t.description
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: ToolChoice | None) -> str | dict[str, Any] | None:
    if choice is None:
        return None
    if choice.type == "tool":
        if choice.name is None:
            raise APIError("tool_choice of type 'tool' needs the tool's name.", param="tool_choice")
        return {"type": "function", "function": {"name": choice.name}}
    if choice.name is not None:
        raise APIError(f"tool_choice.name is only for type 'tool', not {choice.type!r}.", param="tool_choice")
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


@dataclass
class ChatTranslation:
    request: ChatCompletionRequest
    continue_final_message: bool  # the last message is the assistant's: its answer continues it
    parallel_tool_calls: bool = True
    stop_sequences: list[str] = field(default_factory=list)


def _check_thinking(thinking: dict[str, Any] | None, reasoning: bool) -> None:
    """Anthropic's ``thinking``: "enabled" (with its budget_tokens) is accepted with a reasoning
    parser and changes nothing (the model reasons as its chat template makes it); "disabled"
    always."""
    if thinking is None or thinking.get("type") == "disabled":
        return
    if not reasoning:
        raise APIError("thinking is not supported: this server has no reasoning parser.", param="thinking")
    budget = thinking.get("budget_tokens")
    if thinking.get("type") != "enabled" or set(thinking) - {"type", "budget_tokens"}:
        raise APIError(
            "thinking must be {'type': 'enabled', 'budget_tokens': N} or {'type': 'disabled'}.", param="thinking"
        )
    if type(budget) is not int or budget < 1:
        raise APIError("thinking.budget_tokens must be a positive integer.", param="thinking")


def to_chat_request(req: CountTokensRequest, reasoning: bool = False) -> ChatTranslation:
    """The chat completion request a Messages (or count_tokens) request amounts to; 400s name the
    Messages field at fault. count_tokens' tool_choice is checked but steers nothing (the tools
    reach the template whatever it is). ``reasoning``: the server has a reasoning parser."""
    _check_thinking(req.thinking, reasoning)
    choice = _parse(ToolChoice, req.tool_choice, "tool_choice") if req.tool_choice is not None else None
    parallel = not (choice is not None and choice.disable_parallel_tool_use)
    body: dict[str, Any] = {
        "model": req.model,
        "messages": _chat_messages(req, reasoning),
        "tools": _chat_tools(req.tools),
        "tool_choice": _chat_tool_choice(choice),
        "parallel_tool_calls": parallel,
    }
    stop: list[str] = []
    if isinstance(req, MessagesRequest):
        stop = req.stop_sequences or []
        body.update(
            max_tokens=req.max_tokens,
            stop=stop,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            stream=bool(req.stream),
        )
    else:  # what is counted is the prompt: no tool plan (no parser needed), one token to run
        body.update(max_tokens=1, tool_choice="none" if req.tools else None)
    try:
        chat = ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:  # the chat shape nests tool inputs deeper: its depth cap can refuse them
        message, param = validation_error_message(list(e.errors()))
        raise APIError(message, param=param) from None
    return ChatTranslation(chat, req.messages[-1].role == "assistant", parallel, stop)


@dataclass
class AssistantTurn:
    """A finished output as Anthropic reports it."""

    text: str | None
    tool_uses: list[dict[str, Any]]  # {"type": "tool_use", "id", "name", "input"}
    stop_reason: str  # end_turn | max_tokens | stop_sequence | tool_use
    stop_sequence: str | None = None
    thinking: str | None = None  # the reasoning, with a reasoning parser

    def content(self) -> list[dict[str, Any]]:
        # No signature: nothing here verifies thinking sent back (it is left out of the prompt)
        blocks: list[dict[str, Any]] = (
            [{"type": "thinking", "thinking": self.thinking, "signature": ""}] if self.thinking else []
        )
        blocks += [{"type": "text", "text": self.text}] if self.text else []
        return blocks + self.tool_uses


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def finished_turn(
    plan: ToolPlan | None,
    text: str,
    finish_reason: str | None,
    engine_stop_reason: int | str | None,
    parallel: bool,
) -> AssistantTurn:
    """Content, tool uses and stop_reason of a finished output. Calls whose arguments are not a
    JSON object (a forced tool's arguments cut by max_tokens) leave the text as it is."""
    content: str | None = text
    uses: list[dict[str, Any]] = []
    if plan is not None:
        content, calls = plan.calls_of(text)
        for call in calls if parallel else calls[:1]:
            try:
                args = loads(call.arguments)
            except ValueError:
                args = None
            if not isinstance(args, dict):
                content, uses = text, []
                break
            uses.append({"type": "tool_use", "id": tool_use_id(), "name": call.name, "input": args})
    if finish_reason == "length":
        return AssistantTurn(content, uses, "max_tokens")
    if uses:
        return AssistantTurn(content, uses, "tool_use")
    if isinstance(engine_stop_reason, str):  # the stop sequence that ended the text
        return AssistantTurn(content, uses, "stop_sequence", engine_stop_reason)
    return AssistantTurn(content, uses, "end_turn")


def messages_usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, int]:
    """Anthropic's usage: input_tokens are the prompt tokens not read from the cache (its total
    input is input + cache_read + cache_creation; explicit cache writes do not happen here)."""
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "output_tokens": output_tokens,
        "cache_read_input_tokens": cached_tokens,
        "cache_creation_input_tokens": 0,
    }
