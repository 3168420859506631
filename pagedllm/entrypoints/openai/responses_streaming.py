"""A streamed /v1/responses answer: OpenAI's typed events, numbered in order.

response.created, response.in_progress, then per output item (a reasoning item first, when the
server has a reasoning parser: response.output_item.added, response.content_part.added,
response.reasoning_text.delta..., response.reasoning_text.done, response.content_part.done,
response.output_item.done): response.output_item.added, for a
message response.content_part.added, response.output_text.delta..., response.output_text.done,
response.content_part.done; for a function call response.function_call_arguments.delta...,
response.function_call_arguments.done; then response.output_item.done; at the end
response.completed (response.incomplete when cut by max_output_tokens) with the whole response.

How much of the text is sent as it grows, and when a call's item opens and its arguments
stream, follows the chat path's tool plan through tool_streaming.py: all of the text without
tools; under tool_choice "auto" the text that cannot still become a call, then each call (its
item opens with its name; argument deltas as the model writes them, or whole where the format
allows no less); under a named or "required" tool_choice the calls' arguments as written.
"""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.responses_output import (
    function_call_item,
    message_item,
    reasoning_item,
    reasoning_part,
    text_part,
)
from pagedllm.entrypoints.openai.streaming import sse
from pagedllm.entrypoints.openai.tool_calls import ToolPlan
from pagedllm.entrypoints.openai.tool_parsers import ToolCall
from pagedllm.entrypoints.openai.tool_streaming import ToolCallStream


class ResponseEvents:
    """Writes one stream's server-sent events, each with its event name and sequence_number."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, type: str, **fields: Any) -> str:
        event = {"type": type, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {type}\n{sse(event)}"


class StreamedOutput:
    """The output items of one streamed response, built as their events are written."""

    def __init__(self, events: ResponseEvents, plan: ToolPlan | None) -> None:
        self.events = events
        self.plan = plan
        self.items: list[dict[str, Any]] = []  # the finished items, in output order
        self.tools = ToolCallStream(plan)  # the text's content and tool calls, as they grow
        self._message: dict[str, Any] | None = None  # the open message item
        self._text = ""
        self._call: dict[str, Any] | None = None  # the open function call item
        self._reasoning: dict[str, Any] | None = None  # the open reasoning item
        self._thought = ""  # its text so far

    def reason(self, reasoning: str) -> list[str]:
        """The events for the output's reasoning so far (it only grows, and ends before any
        content: the item closes when the first content or call is sent)."""
        delta = reasoning[len(self._thought) :]
        if not delta:
            return []
        out = []
        if self._reasoning is None:
            self._reasoning = reasoning_item(None, "in_progress")
            out.append(self.events("response.output_item.added", output_index=len(self.items), item=self._reasoning))
            at = self._at(self._reasoning)
            out.append(self.events("response.content_part.added", **at, content_index=0, part=reasoning_part("")))
        self._thought += delta
        at = self._at(self._reasoning)
        out.append(self.events("response.reasoning_text.delta", **at, content_index=0, delta=delta))
        return out

    def _close_reasoning(self, status: str = "completed") -> list[str]:
        if self._reasoning is None:
            return []
        item, text = self._reasoning, self._thought
        self._reasoning = None
        at = self._at(item)
        return [
            self.events("response.reasoning_text.done", **at, content_index=0, text=text),
            self.events("response.content_part.done", **at, content_index=0, part=reasoning_part(text)),
            self._item_done(reasoning_item(text, status, id=item["id"])),
        ]

    def update(self, text: str, finished: bool) -> list[str]:
        """The events for the output's text so far (``finished``: its final text)."""
        step = self.tools.update(text, finished)
        out = self._text_delta(step.content) if step.content else []
        for d in step.calls:
            if d.name is not None:
                out.extend(self._open_call(ToolCall(d.name, "", d.id)))
            else:
                out.extend(self._arguments(d.arguments))
        return out

    def finish(self, status: str) -> list[str]:
        """The closing events of every open item (after ``update`` with the final text)."""
        out = self._close_reasoning(status) + self._close_message(status) + self._close_call(status)
        if all(it["type"] == "reasoning" for it in self.items):  # an empty answer is still one (empty)
            # message, as without streaming
            out.extend(self._text_delta(""))
            out.extend(self._close_message(status))
        return out

    def _at(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": len(self.items)}

    def _item_done(self, item: dict[str, Any]) -> str:
        event = self.events("response.output_item.done", output_index=len(self.items), item=item)
        self.items.append(item)
        return event

    def _text_delta(self, delta: str) -> list[str]:
        out = self._close_reasoning() + self._close_call("completed")
        if self._message is None:
            self._message = message_item(None, "in_progress")
            self._text = ""
            out.append(self.events("response.output_item.added", output_index=len(self.items), item=self._message))
            at = self._at(self._message)
            out.append(self.events("response.content_part.added", **at, content_index=0, part=text_part("")))
        if delta:
            self._text += delta
            at = self._at(self._message)
            out.append(self.events("response.output_text.delta", **at, content_index=0, delta=delta, logprobs=[]))
        return out

    def _close_message(self, status: str) -> list[str]:
        if self._message is None:
            return []
        message, text = self._message, self._text
        self._message = None
        at = self._at(message)
        part = text_part(text)
        done = message_item(text, status, id=message["id"])
        return [
            self.events("response.output_text.done", **at, content_index=0, text=text, logprobs=[]),
            self.events("response.content_part.done", **at, content_index=0, part=part),
            self._item_done(done),
        ]

    def _open_call(self, call: ToolCall) -> list[str]:
        """A function call item, opened when its name is known; the items before it close."""
        out = self._close_reasoning() + self._close_message("completed") + self._close_call("completed")
        self._call = function_call_item(call, "in_progress")
        out.append(self.events("response.output_item.added", output_index=len(self.items), item=dict(self._call)))
        return out

    def _arguments(self, delta: str) -> list[str]:
        """More of the open call's arguments, as the model writes them."""
        assert self._call is not None
        self._call["arguments"] += delta
        return [self.events("response.function_call_arguments.delta", **self._at(self._call), delta=delta)]

    def _close_call(self, status: str) -> list[str]:
        if self._call is None:
            return []
        call, self._call = self._call, None
        call["status"] = status
        done = self.events("response.function_call_arguments.done", **self._at(call), arguments=call["arguments"])
        return [done, self._item_done(call)]
