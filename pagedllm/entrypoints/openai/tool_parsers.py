"""Tool-call parsers (``--tool-call-parser NAME``): a model's raw text -> content + tool calls, in the
format its chat template teaches it (vLLM's parser names).

- ``hermes`` (Hermes, Qwen2/2.5, SmolLM...): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks; text before the first block is content.
- ``llama3_json`` (Llama 3.1/3.2): the whole answer is ``{"name": ..., "parameters": {...}}`` (optionally
  after ``<|python_tag|>``; several separated by ``;``); anything else is content.

A parser also says how much of a growing text can be streamed as content (the rest might still
become a tool call).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's function.arguments)
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return d if index is None else {"index": index, **d}


# What a model's text can make json raise: malformed text, and nesting deeper than Python's
# recursion limit (a model may write thousands of "[" before it is cut off).
JSON_ERRORS = (ValueError, RecursionError)


def loads(text: str) -> object:
    """json.loads, or a ValueError for anything it cannot read (also nesting too deep)."""
    try:
        return json.loads(text)
    except RecursionError as e:
        raise ValueError("JSON nested too deeply") from e


def call_of(obj: object, args_key: str) -> ToolCall | None:
    """The call ``obj`` describes ({"name": str, args_key or "arguments": object or its JSON
    text}), or None: anything else is not a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    try:
        if isinstance(args, str):  # some models write the arguments as a JSON string already
            args = loads(args)
        if not isinstance(args, dict):
            return None
        return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))
    except JSON_ERRORS:
        return None


def _held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that begins ``marker`` (it may grow into it)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolParser:
    name = ""

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content or None, tool calls); no calls: the whole text is content."""
        raise NotImplementedError

    def streamable_len(self, text: str) -> int:
        """How many leading characters of a partial ``text`` are content whatever follows."""
        raise NotImplementedError


class HermesToolParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
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

    def streamable_len(self, text: str) -> int:
        start = text.find(self.START)
        if start >= 0:
            return start
        return len(text) - _held_back(text, self.START)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG) :].strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except JSON_ERRORS:
                return text, []
            call = call_of(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            rest = body[end:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            elif rest:
                return text, []
            pos = len(body) - len(rest)
        return None, calls

    def streamable_len(self, text: str) -> int:
        body = text.lstrip()
        if not body or body.startswith("{") or self.TAG.startswith(body[: len(self.TAG)]):
            return 0  # may be (or become) a tool call: hold it until the end
        return len(text)


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser)}


def tool_parser(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"Unknown tool call parser {name!r}; available: {', '.join(sorted(PARSERS))}.")
    return PARSERS[name]()
