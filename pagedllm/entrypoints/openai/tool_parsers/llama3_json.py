"""``llama3_json`` (Llama 3.1/3.2): the whole answer is ``{"name": ..., "parameters": {...}}``
(optionally after ``<|python_tag|>``; several separated by ``;``); anything else is content."""

from __future__ import annotations

import json
import re
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.base import JSON_ERRORS, ToolCall, WholeAnswerToolParser, call_of
from pagedllm.entrypoints.openai.tool_parsers.partial import PartialCall, header, object_calls

_HEADER = header("parameters|arguments")
_BETWEEN = re.compile(r"\s*\}\s*;?\s*(?=\{)")


class Llama3JsonToolParser(WholeAnswerToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"
    OPENINGS = ("{", TAG)

    def extract(self, text: str, tools: list[dict[str, Any]] | None = None) -> tuple[str | None, list[ToolCall]]:
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

    def partial_calls(self, text: str, tools: list[dict[str, Any]] | None = None) -> list[PartialCall]:
        body = text.lstrip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG) :]
        calls: list[PartialCall] = []
        object_calls(text, len(text) - len(body), _HEADER, _BETWEEN, calls)
        return calls
