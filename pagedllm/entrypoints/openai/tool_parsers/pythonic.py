"""``pythonic`` (Llama 3.2 and 4, ToolACE...): the whole answer is a Python list of calls,
``[get_weather(city="Paris", unit="c"), get_time(zone=2)]``; anything else is content.

Read with ``ast.parse`` (never evaluated): each element must be a call of a plain name with
keyword arguments only, whose values are literals that JSON can carry (strings, numbers,
booleans, None, lists, tuples, dicts with string keys); a keyword given twice is not a call.

Streamed, a call opens when its name and ``(`` are written, and its arguments go out a keyword
at a time, as each one's value ends (Python's tokenizer finds where: brackets and strings).
"""

from __future__ import annotations

import ast
import io
import tokenize
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.base import ToolCall, WholeAnswerToolParser, arguments_json
from pagedllm.entrypoints.openai.tool_parsers.partial import PartialCall

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
        if kw.arg is None or kw.arg in args:  # **kwargs, or a keyword repeated (Python refuses it)
            return None
        value = ast.literal_eval(kw.value)
        if not _json_literal(value):
            return None
        args[kw.arg] = value
    return ToolCall(node.func.id, arguments_json(args))


def _tokens(text: str) -> list[tokenize.TokenInfo]:
    """The tokens of a partial ``text`` up to where it stops being readable (an open string...)."""
    tokens: list[tokenize.TokenInfo] = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            tokens.append(tok)
    except (tokenize.TokenError, SyntaxError, IndentationError):
        pass
    return tokens


def _offsets(text: str) -> list[int]:
    starts, pos = [0], 0
    for line in text.splitlines(keepends=True):
        pos += len(line)
        starts.append(pos)
    return starts


def _arguments_text(source: str) -> str | None:
    """The arguments JSON of the keyword arguments ``source`` (``a=1, b="x"``), None if they are
    not literals JSON can carry."""
    try:
        call = _call(ast.parse(f"f({source})", mode="eval").body)
    except _AST_ERRORS:
        return None
    return call.arguments if call is not None else None


def partial_calls(text: str) -> list[PartialCall]:
    """The calls a partial pythonic answer has begun: each opened at ``name(``, its arguments so
    far a start of the finished arguments text (the keywords whose values have ended)."""
    lines = _offsets(text)
    calls: list[PartialCall] = []
    depth, opened_at, name, call_at = 0, -1, "", 0
    toks = [t for t in _tokens(text) if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT)]
    for i, tok in enumerate(toks):
        if tok.type == tokenize.ERRORTOKEN and not tok.string.isspace():
            return calls  # an open string (Python 3.11 reads on past it): wait for more text
        at = lines[tok.start[0] - 1] + tok.start[1]
        if tok.type == tokenize.OP and tok.string in "([{":
            depth += 1
            if depth == 1 and tok.string != "[":
                return calls  # not a list of calls: the finished text decides
            if depth == 2 and tok.string == "(" and i > 0 and toks[i - 1].type == tokenize.NAME:
                name, opened_at, call_at = toks[i - 1].string, at + 1, len(calls)
                calls.append(PartialCall(name))
        elif tok.type == tokenize.OP and tok.string in ")]}":
            if depth == 2 and tok.string == ")" and opened_at >= 0:
                calls[call_at].arguments = _arguments_text(text[opened_at:at])
                opened_at = -1
            depth -= 1
        elif depth == 2 and opened_at >= 0 and tok.type == tokenize.OP and tok.string == ",":
            so_far = _arguments_text(text[opened_at:at])
            if so_far is None:
                return calls
            calls[call_at].arguments = so_far[:-1]  # without the object's closing brace
    return calls


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

    def partial_calls(self, text: str, tools: list[dict[str, Any]] | None = None) -> list[PartialCall]:
        return partial_calls(text) if text.lstrip().startswith("[") else []
