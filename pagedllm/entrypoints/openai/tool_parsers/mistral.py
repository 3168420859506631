"""``mistral`` (Mistral 7B v0.3, Nemo, Small, Devstral, Magistral): calls follow ``[TOOL_CALLS]``;
text before the first is content. After it, one of:

- a JSON list of ``{"name": ..., "arguments": {...}}`` (tokenizers before v11);
- ``name[ARGS]{...}``, each call after its own ``[TOOL_CALLS]`` (v11 and later), optionally
  ``name[CALL_ID]id[ARGS]{...}``, or ``name{...}`` where ``[ARGS]`` was dropped from the text.

``[TOOL_CALLS]`` is a special token, so the output keeps special tokens (as vLLM does). Call ids
are 9 letters and digits: Mistral's chat templates refuse any other id in the next turn.
"""

from __future__ import annotations

import json
import random
import re
import string
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.base import (
    JSON_ERRORS,
    MarkedToolParser,
    ToolCall,
    arguments_json,
    call_of,
)
from pagedllm.entrypoints.openai.tool_parsers.partial import PartialCall, header, json_end, object_calls

_ID_CHARS = string.ascii_letters + string.digits
# name, optional [CALL_ID]id, optional [ARGS], then the arguments object.
_NAMED = re.compile(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[CALL_ID\]\s*([A-Za-z0-9]+)\s*)?(?:\[ARGS\])?\s*(?=\{)")
_LIST = re.compile(r"\s*\[(?=\s*\{)")
_HEADER = header("arguments")
_BETWEEN = re.compile(r"\s*\}\s*,\s*(?=\{)")


def mistral_call_id() -> str:
    return "".join(random.choices(_ID_CHARS, k=9))


def _mistral_call(call: ToolCall | None, call_id: str | None = None) -> ToolCall | None:
    if call is not None:
        call.id = call_id or mistral_call_id()
    return call


def _json_calls(segment: str) -> list[ToolCall] | None:
    """The calls of a JSON list (or one object) of calls, nothing after it; None if not that."""
    try:
        obj, end = json.JSONDecoder().raw_decode(segment)
    except JSON_ERRORS:
        return None
    if segment[end:].strip():
        return None
    items = obj if isinstance(obj, list) else [obj]
    calls = [_mistral_call(call_of(item, "arguments")) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


def _named_call(segment: str) -> ToolCall | None:
    """The call of ``name[ARGS]{...}`` (and its variants), nothing after the object; or None."""
    m = _NAMED.match(segment)
    if m is None:
        return None
    try:
        args, end = json.JSONDecoder().raw_decode(segment, m.end())
        if not isinstance(args, dict) or segment[end:].strip():
            return None
        return _mistral_call(ToolCall(m.group(1), arguments_json(args)), m.group(2))
    except JSON_ERRORS:
        return None


class MistralToolParser(MarkedToolParser):
    name = "mistral"
    START = "[TOOL_CALLS]"
    keeps_special_tokens = True

    def extract(self, text: str, tools: list[dict[str, Any]] | None = None) -> tuple[str | None, list[ToolCall]]:
        start = text.find(self.START)
        if start < 0:
            return text, []
        calls: list[ToolCall] = []
        for segment in text[start + len(self.START) :].split(self.START):
            body = segment.strip()
            found = _json_calls(body) if body[:1] in ("[", "{") else None
            if found is None:
                call = _named_call(body)
                found = [call] if call is not None else None
            if found is None:  # a malformed call: the answer is text, as the model wrote it
                return text, []
            calls.extend(found)
        content = text[:start].strip()
        return content or None, calls

    def partial_calls(self, text: str, tools: list[dict[str, Any]] | None = None) -> list[PartialCall]:
        calls: list[PartialCall] = []
        start = text.find(self.START)
        while start >= 0:
            pos = start + len(self.START)
            m = _NAMED.match(text, pos)
            if m is not None:
                calls.append(PartialCall(m.group(1), args_at=m.end(), call_id=m.group(2)))
                end = json_end(text, m.end())
            else:
                listed = _LIST.match(text, pos)
                end = object_calls(text, listed.end() if listed else pos, _HEADER, _BETWEEN, calls)
            if end is None:  # the last call is still being written (or not in a form streamed)
                break
            start = text.find(self.START, end)
        return calls

    def call_id(self) -> str:
        return mistral_call_id()
