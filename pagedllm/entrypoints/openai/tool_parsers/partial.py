"""The calls a partial output has begun, for streaming them (tool_streaming.py): a call is
opened once its name is known; its arguments stream from where their JSON object begins
(re-written as they are read, json_stream.py), or as the format gives them: a growing start of
the finished call's arguments text (all of it once the call is complete).

What is found in a prefix of the text is found, the same, in every longer text (the patterns are
anchored and end where the text fixes them), so a stream never has to take a call back unless
the finished text turns out not to hold calls at all."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from pagedllm.entrypoints.openai.tool_parsers.base import JSON_ERRORS, loads


@dataclass
class PartialCall:
    name: str
    args_at: int | None = None  # where its arguments object begins in the text (streamed as read)
    arguments: str | None = None  # or its arguments text so far (whole once the call is complete)
    call_id: str | None = None  # the id the text gives it (Mistral's [CALL_ID])
    raw: bool = False  # the arguments are the text itself, not re-written (a named tool_choice)


_STRING = r'"(?:[^"\\]|\\.)*"'


def header(args_keys: str) -> re.Pattern[str]:
    """A call object's beginning up to its arguments object: ``{"name": "...", "<key>": {``."""
    return re.compile(r'\s*\{\s*"name"\s*:\s*(' + _STRING + r')\s*,\s*"(?:' + args_keys + r')"\s*:\s*(?=\{)', re.S)


def json_end(text: str, pos: int) -> int | None:
    """Where the JSON value at ``pos`` ends, or None while it is incomplete (or not JSON)."""
    try:
        _, end = json.JSONDecoder().raw_decode(text, pos)
    except JSON_ERRORS:
        return None
    return end


def name_of(literal: str) -> str | None:
    try:
        name = loads(literal)
    except ValueError:
        return None
    return name if isinstance(name, str) else None


def object_calls(
    text: str, pos: int, head: re.Pattern[str], between: re.Pattern[str], calls: list[PartialCall]
) -> int | None:
    """Appends the calls of consecutive call objects from ``pos`` (``head`` each, ``between``
    after each object's arguments up to the next one's ``{``); returns where the last complete
    call's arguments end (None if the first call has not begun)."""
    end = None
    while True:
        m = head.match(text, pos)
        name = name_of(m.group(1)) if m else None
        if m is None or name is None:
            return end
        calls.append(PartialCall(name, args_at=m.end()))
        args_end = json_end(text, m.end())
        if args_end is None:
            return end
        end = args_end
        nxt = between.match(text, args_end)
        if nxt is None:
            return end
        pos = nxt.end()
