"""What /v1/responses returns: output items, usage and the response object, in OpenAI's shapes.

A finished output is its reasoning as one ``reasoning`` item when the server has a reasoning
parser and the output has reasoning (reasoning_parsers.py), then at most one ``message`` item
(its text) followed by one ``function_call`` item per tool call the chat path's tool plan found
in the text (tool_calls.py). The same items, as chat messages, continue the conversation of a
later ``previous_response_id``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
from pagedllm.entrypoints.openai.tool_calls import ToolPlan
from pagedllm.entrypoints.openai.tool_parsers import ToolCall
from pagedllm.outputs import RequestOutput


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def status_of(finish_reason: str | None) -> str:
    """A finished output's status: cut by the token limit is "incomplete", as OpenAI says it."""
    return "incomplete" if finish_reason == "length" else "completed"


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(text: str | None, status: str, id: str | None = None) -> dict[str, Any]:
    """An assistant message item; ``text`` None: the item as it opens, before any text."""
    content = [] if text is None else [text_part(text)]
    return {"id": id or item_id("msg"), "type": "message", "status": status, "role": "assistant", "content": content}


def reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def reasoning_item(text: str | None, status: str, id: str | None = None) -> dict[str, Any]:
    """A reasoning item: the model's reasoning as its content (no summary is written: ``summary``
    stays empty); ``text`` None: the item as it opens."""
    content = [] if text is None else [reasoning_part(text)]
    return {"id": id or item_id("rs"), "type": "reasoning", "summary": [], "content": content, "status": status}


def function_call_item(call: ToolCall, status: str, id: str | None = None) -> dict[str, Any]:
    return {
        "id": id or item_id("fc"),
        "type": "function_call",
        "status": status,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
    }


def output_items(plan: ToolPlan | None, text: str, status: str, reasoning: str | None = None) -> list[dict[str, Any]]:
    """The items of a finished output: its ``reasoning``, its content (``text``, the output
    after the reasoning) as a message, then its tool calls."""
    content, calls = plan.calls_of(text) if plan is not None else (text, [])
    items = [reasoning_item(reasoning, status)] if reasoning else []
    items += [message_item(content, status)] if content or not calls else []
    return items + [function_call_item(c, status) for c in calls]


def assistant_message(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The output items as the chat message that continues the conversation."""
    text = "".join(p["text"] for it in items if it["type"] == "message" for p in it["content"])
    message: dict[str, Any] = {"role": "assistant", "content": text}
    calls = [
        {"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
        for it in items
        if it["type"] == "function_call"
    ]
    if calls:
        message["tool_calls"] = calls
    return message


def cached_tokens(out: RequestOutput | None) -> int:
    """The prompt tokens this request found in the prefix cache, as the engine counted them
    (RequestOutput.num_cached_tokens: the number chat's and completions' cached_tokens report)."""
    return out.num_cached_tokens if out is not None else 0


def usage(input_tokens: int, output_tokens: int, cached: int, reasoning: int = 0) -> dict[str, Any]:
    """``reasoning``: the output tokens of its reasoning section (the end of think tag included)."""
    return {
        "input_tokens": input_tokens,
        # cache_write_tokens counts OpenAI's retained cache writes (with a TTL): none here, the
        # prefix cache keeps blocks only while memory allows
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": input_tokens + output_tokens,
    }


class ResponseShell:
    """The fields of one response that do not depend on its output (what the request asked)."""

    def __init__(self, req: ResponsesRequest, model: str, text_format: dict[str, Any]) -> None:
        self.id = item_id("resp")
        self.created_at = int(time.time())
        self.req = req
        self.model = model
        self.text_format = text_format

    def response(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        req = self.req
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": None,
            "metadata": req.metadata or {},
            "model": self.model,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning,
            "store": req.store is not False,
            "temperature": req.temperature,
            "text": {"format": self.text_format},
            "tool_choice": req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none"),
            "tools": req.tools or [],
            "top_p": req.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": req.user,
        }
