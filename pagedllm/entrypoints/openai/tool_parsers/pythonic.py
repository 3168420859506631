"""``pythonic`` (Llama 3.2 and 4, ToolACE...): the whole answer is a Python list of calls,
``[get_weather(city="Paris", unit="c"), get_time(zone=2)]``; anything else is content.

Read with ``ast.parse`` (never evaluated): each element must be a call of a plain name with
keyword arguments only, whose values are literals that JSON can carry (strings, numbers,
booleans, None, lists, tuples, dicts with string keys).
"""

from __future__ import annotations

import ast
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.base import ToolCall, WholeAnswerToolParser, arguments_json

# What ast and literal_eval raise on what a model may write: bad syntax, nesting past the
# parser's or the recursion limit, an int literal longer than Python converts, non-literals.
_AST_ERRORS = (SyntaxError, ValueError, TypeError, RecursionError, MemoryError)


def _json_literal(value: object) -> bool:
    """Whether literal_eval's ``value`` is one JSON can carry, as itself (no sets, bytes, complex
    numbers or non-string keys)."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_json_literal(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_literal(v) for k, v in value.items())
    return False


def _call(node: ast.expr) -> ToolCall | None:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    args: dict[str, object] = {}
    for kw in node.keywords:
        if kw.arg is None:  # **kwargs
            return None
        value = ast.literal_eval(kw.value)
        if not _json_literal(value):
            return None
        args[kw.arg] = value
    return ToolCall(node.func.id, arguments_json(args))


class PythonicToolParser(WholeAnswerToolParser):
    name = "pythonic"
    OPENINGS = ("[",)

    def extract(self, text: str, tools: list[dict[str, Any]] | None = None) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        if not body.startswith("[") or not body.endswith("]"):
            return text, []
        try:
            tree = ast.parse(body, mode="eval")
            if not isinstance(tree.body, ast.List) or not tree.body.elts:
                return text, []
            calls = [_call(node) for node in tree.body.elts]
        except _AST_ERRORS:
            return text, []
        if any(c is None for c in calls):
            return text, []
        return None, calls  # type: ignore[return-value]
