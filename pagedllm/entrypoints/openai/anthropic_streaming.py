"""A streamed /v1/messages answer: Anthropic's server-sent events, in its order.

message_start (the message without content, usage with the prompt's counts), ping, then per
content block content_block_start, its deltas (thinking_delta then one signature_delta for a
thinking block, text_delta for text, input_json_delta for a tool_use) and content_block_stop,
then message_delta (stop_reason, stop_sequence, usage) and message_stop. A failure after the 200
is an ``error`` event in Anthropic's error shape.

message_start waits for the engine's first output: only then is it known how much of the prompt
came from the prefix cache. Text is streamed as it is generated, except what the tool-call
parser holds back (it may still become a call); a tool_use block opens when its call's name is
known, and its input streams as input_json_delta fragments as the model writes it (a forced
tool's, and JSON arguments of the auto parsers), or in one delta where the format allows no less
(tool_streaming.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from pagedllm.engine.client import OutputStream
from pagedllm.entrypoints.openai.anthropic_convert import (
    ChatTranslation,
    finished_turn,
    messages_usage,
    tool_use_id,
)
from pagedllm.entrypoints.openai.anthropic_errors import anthropic_error_body
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat, PreparedChat
from pagedllm.entrypoints.openai.streaming import abort_all, merge_streams, sse
from pagedllm.entrypoints.openai.tool_streaming import ToolCallStream


def event(kind: str, data: dict[str, Any] | None = None) -> str:
    """One Anthropic event: its type as the SSE event name and as the data's ``type``."""
    return f"event: {kind}\n" + sse({"type": kind, **(data or {})})


class _Blocks:
    """The content blocks of a streamed message: numbered in order, one open at a time."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None  # the open block's type

    def start(self, block: dict[str, Any]) -> list[str]:
        events = self.stop()
        self.index += 1
        self.kind = block["type"]
        return [*events, event("content_block_start", {"index": self.index, "content_block": block})]

    def delta(self, delta: dict[str, Any]) -> str:
        return event("content_block_delta", {"index": self.index, "delta": delta})

    def stop(self) -> list[str]:
        if self.kind is None:
            return []
        # Anthropic ends a thinking block with its signature; this server signs nothing: empty
        signature = [self.delta({"type": "signature_delta", "signature": ""})] if self.kind == "thinking" else []
        self.kind = None
        return [*signature, event("content_block_stop", {"index": self.index})]


async def message_events(
    serving: OpenAIServingChat,
    message_id: str,
    streams: list[OutputStream],
    prep: PreparedChat,
    translation: ChatTranslation,
) -> AsyncIterator[str]:
    plan = prep.plan
    prompt_tokens = len(prep.prompt["prompt_token_ids"])
    tools = ToolCallStream(plan)  # the text's content and tool calls, as they grow
    blocks = _Blocks()
    thought = 0  # characters of the reasoning already sent
    cached = 0
    started = False
    try:
        async for _, out in merge_streams(streams):
            c = out.outputs[0]
            if not started:
                started, cached = True, out.num_cached_tokens
                message = {
                    "id": message_id,
                    "type": "message",
                    "role": "assistant",
                    "content": [],
                    "model": prep.model,
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": messages_usage(prompt_tokens, cached, 0),
                }
                yield event("message_start", {"message": message})
                yield event("ping")
            finish = c.finish_reason
            parts = serving.split(c.text, finish is not None)
            text = parts.content
            if parts.reasoning and len(parts.reasoning) > thought:
                if blocks.kind != "thinking":
                    for e in blocks.start({"type": "thinking", "thinking": "", "signature": ""}):
                        yield e
                yield blocks.delta({"type": "thinking_delta", "thinking": parts.reasoning[thought:]})
                thought = len(parts.reasoning)
            step = tools.update(text, finish is not None)
            if step.content:
                if blocks.kind != "text":
                    for e in blocks.start({"type": "text", "text": ""}):
                        yield e
                yield blocks.delta({"type": "text_delta", "text": step.content})
            for d in step.calls:
                if d.index > 0 and not translation.parallel_tool_calls:
                    continue  # one call only: the others are dropped, as without streaming
                if d.name is not None:  # Anthropic's start: the block with an empty input
                    for e in blocks.start({"type": "tool_use", "id": tool_use_id(), "name": d.name, "input": {}}):
                        yield e
                else:
                    yield blocks.delta({"type": "input_json_delta", "partial_json": d.arguments})
            if finish is None:
                continue
            turn = finished_turn(plan, text, finish, c.stop_reason, translation.parallel_tool_calls)
            for e in blocks.stop():
                yield e
            yield event(
                "message_delta",
                {
                    "delta": {"stop_reason": turn.stop_reason, "stop_sequence": turn.stop_sequence},
                    "usage": messages_usage(prompt_tokens, cached, len(c.token_ids)),
                },
            )
            yield event("message_stop")
            return
    except Exception as e:  # after the 200: an error event, never a cut stream
        yield event("error", {"error": anthropic_error_body(serving.stream_failure(e))["error"]})
    finally:
        abort_all(streams)
