"""``hermes`` (Hermes, Qwen2/2.5, SmolLM...): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
blocks; text before the first block is content."""

from __future__ import annotations

import re
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.base import MarkedToolParser, ToolCall, call_of, loads
from pagedllm.entrypoints.openai.tool_parsers.partial import PartialCall, header, object_calls

_HEADER = header("arguments")
_NEVER = re.compile(r"(?!)")  # one call object per block


class HermesToolParser(MarkedToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def extract(self, text: str, tools: list[dict[str, Any]] | None = None) -> tuple[str | None, list[ToolCall]]:
        start = text.find(self.START)
        if start < 0:
            return text, []
        calls = []
        for m in self._BLOCK.finditer(text, start):
            try:
                call = call_of(loads(m.group(1)), "arguments")
            except ValueError:
                call = None
            if call is None:  # a malformed block: the answer is text, as the model wrote it
                return text, []
            calls.append(call)
        content = text[:start].strip()
        return content or None, calls

    def partial_calls(self, text: str, tools: list[dict[str, Any]] | None = None) -> list[PartialCall]:
        calls: list[PartialCall] = []
        start = text.find(self.START)
        while start >= 0:
            end = object_calls(text, start + len(self.START), _HEADER, _NEVER, calls)
            if end is None:  # this block's call has not begun, or is not in this form
                break
            start = text.find(self.START, end)
        return calls
