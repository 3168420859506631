"""``hermes`` (Hermes, Qwen2/2.5, SmolLM...): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
blocks; text before the first block is content."""

from __future__ import annotations

import re
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.base import MarkedToolParser, ToolCall, call_of, loads


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
