"""What every tool-call parser shares: the call it finds, JSON reading that never raises anything
but ValueError, and the streaming contract (how much of a growing text is content for sure)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.entrypoints.openai.tool_parsers.partial import PartialCall


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


def arguments_json(args: dict) -> str:
    """OpenAI's function.arguments text of an arguments object; ValueError if it is not JSON
    (a float that is infinite or NaN, a key that is not a string, nesting too deep)."""
    try:
        return json.dumps(args, ensure_ascii=False, allow_nan=False, skipkeys=False)
    except (TypeError, RecursionError) as e:
        raise ValueError("arguments are not JSON") from e


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
        return ToolCall(obj["name"], arguments_json(args))
    except JSON_ERRORS:
        return None


def held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that begins ``marker`` (it may grow into it)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolParser:
    """A model's raw text -> (content, tool calls), in the format its chat template teaches it.

    Streaming contract (tool_streaming.py): while the text grows, its first
    ``streamable_len(text)`` characters are sent as content, and the calls ``partial_calls(text)``
    has begun are sent as they grow; when it is finished, ``extract`` decides: the calls not sent
    yet, and the rest of each call's arguments, follow; without calls the rest of the text follows
    as content. So ``streamable_len`` of any prefix never reaches past where the calls begin, and
    neither it nor what ``partial_calls`` finds changes as the text grows, but by growing."""

    name = ""
    # The format's markers are special tokens (Mistral's [TOOL_CALLS]): the output must keep them.
    keeps_special_tokens = False

    def extract(self, text: str, tools: list[dict[str, Any]] | None = None) -> tuple[str | None, list[ToolCall]]:
        """(content or None, tool calls); no calls: the whole text is content. ``tools``: the
        request's (OpenAI's shape), for formats whose arguments are typed by the tool's schema.
        Never raises on what a model writes."""
        raise NotImplementedError

    def streamable_len(self, text: str) -> int:
        """How many leading characters of a partial ``text`` are content whatever follows."""
        raise NotImplementedError

    def partial_calls(self, text: str, tools: list[dict[str, Any]] | None = None) -> list[PartialCall]:
        """The calls a partial ``text`` has begun, in order (partial.py). By default none: the
        calls are sent when the output is finished."""
        return []

    def call_id(self) -> str:
        """A new call's id, in the form the format's chat templates accept back."""
        return ToolCall("", "").id


class MarkedToolParser(ToolParser):
    """Formats where the calls follow a marker (``START``) and the text before it is content."""

    START = ""

    def streamable_len(self, text: str) -> int:
        start = text.find(self.START)
        if start >= 0:
            return start
        return len(text) - held_back(text, self.START)


class WholeAnswerToolParser(ToolParser):
    """Formats where the calls are the whole answer, which then begins with one of ``OPENINGS``:
    an answer that does (or may yet) is held back until it is finished."""

    OPENINGS: tuple[str, ...] = ()

    def streamable_len(self, text: str) -> int:
        body = text.lstrip()
        if not body or any(body.startswith(o) or o.startswith(body) for o in self.OPENINGS):
            return 0
        return len(text)
